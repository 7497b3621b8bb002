"""Constrained decoding: a logits processor that keeps the output inside a small grammar (one JSON object, or a fixed
frame around one such as a tool call), checked character by character over each candidate token's text.

A grammar is made of parts (`Literal`, `Choice`, `JsonObject`) joined by `Sequence`. Each part steps immutable,
hashable states one character at a time (`step(state, ch) -> state | None`), so checking a candidate token copies
nothing and (state, token) results can be cached. The processor looks at candidates in descending logit order and
stops once the valid ones it found cover the distribution's likely mass: greedy decoding usually checks one or two
tokens per step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastdecode.engine.json_schema import object_keys
from fastdecode.errors import InvalidRequestError

WHITESPACE = " \t\n\r"
MAX_WHITESPACE_RUN = 32  # a model stuck emitting blank lines inside an object must move on
MAX_DEPTH = 32  # nesting deeper than this is a runaway, not data
ESCAPES = '"\\/bfnrt'
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"


class Literal:
    """Exactly `text`. State: characters matched so far."""

    def __init__(self, text: str):
        self.text = text
        self.start = 0

    def step(self, pos: int, ch: str):
        return pos + 1 if pos < len(self.text) and self.text[pos] == ch else None

    def done(self, pos: int) -> bool:
        return pos == len(self.text)


class Choice:
    """One of `options`, none a prefix of another. State: the text matched so far."""

    def __init__(self, options: list[str]):
        if any(a != b and b.startswith(a) for a in options for b in options):
            raise ValueError("no option of a Choice may be a prefix of another")
        self.options = list(options)
        self.start = ""

    def step(self, prefix: str, ch: str):
        prefix += ch
        return prefix if any(o.startswith(prefix) for o in self.options) else None

    def done(self, prefix: str) -> bool:
        return prefix in self.options


class KeyTrie:
    """The keys an object may hold, as a trie whose nodes carry a bit mask of the keys below them: whether a prefix
    still leads to an unused key is one mask test, whatever the number of keys."""

    def __init__(self, keys: list[str]):
        self.index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        self.children: list[dict[str, int]] = [{}]
        self.below = [0]  # bit i: key i lies below the node
        self.key = [-1]  # the key the node spells, or -1
        for k, i in self.index.items():
            node = 0
            self.below[0] |= 1 << i
            for ch in k:
                if ch not in self.children[node]:
                    self.children[node][ch] = len(self.children)
                    self.children.append({})
                    self.below.append(0)
                    self.key.append(-1)
                node = self.children[node][ch]
                self.below[node] |= 1 << i
            self.key[node] = i

    def mask(self, keys) -> int:
        return sum(1 << self.index[k] for k in set(keys) & self.index.keys())


# The first character of a JSON value of each JSON Schema type.
TYPE_FIRST_CHARS = {"string": '"', "number": "-" + DIGITS, "integer": "-" + DIGITS, "boolean": "tf", "null": "n",
                    "object": "{", "array": "["}


def first_chars(type_) -> str | None:
    """The characters a value of JSON Schema type `type_` (a name, a list of names, or absent) may start with; None
    where the type says nothing the grammar can use (absent, unknown names)."""
    names = [type_] if isinstance(type_, str) else type_ if isinstance(type_, list) else []
    if not names or not all(isinstance(n, str) and n in TYPE_FIRST_CHARS for n in names):
        return None
    return "".join(TYPE_FIRST_CHARS[n] for n in names)


class JsonObject:
    """One JSON object (RFC 8259) with optional whitespace before it, as a pushdown recognizer.

    `keys`, when given, are the only keys its top level may hold (each once; a function's `properties`), and the
    object closes only once every key in `required` is there. `types` (key -> a JSON Schema "type", a name or a list
    of names) makes a top-level key's value start as its type does: a "string" property gets a string, not an
    object. Values are otherwise any JSON.

    State: (mode, stack, aux, whitespace run, top-level keys used as a bit mask over the trie's keys). stack holds
    "o"/"a" for the open objects and arrays; aux is the string kind ("key"/"value"), the trie node of a restricted
    key being read (mode "rkey"), the index of the restricted key whose value is due (modes "colon", "value"), the
    unmatched rest of a literal (true/false/null) or the hex digits still due."""

    def __init__(self, keys: list[str] | None = None, required: list[str] = (), types: dict | None = None):
        self.trie = None if keys is None else KeyTrie(keys)
        self.required = self.trie.mask(required) if self.trie is not None else 0
        # per restricted key, the characters its value may start with (None: any value)
        self.first = [] if self.trie is None else [first_chars((types or {}).get(k)) for k in self.trie.index]
        self.start = ("start", "", "", 0, 0)

    def done(self, state) -> bool:
        return state[0] == "done"

    def step(self, state, ch: str):
        mode, stack, aux, ws, used = state
        if mode == "rkey":
            return self._restricted_key(stack, aux, used, ch)
        if mode == "str":
            if ch == '"':
                return ("colon", stack, "", 0, used) if aux == "key" else ("after", stack, "", 0, used)
            if ch == "\\":
                return ("esc", stack, aux, 0, used)
            return None if ord(ch) < 0x20 else state
        if mode == "esc":
            if ch == "u":
                return ("hex", stack, aux + "4", 0, used)
            return ("str", stack, aux, 0, used) if ch in ESCAPES else None
        if mode == "hex":
            if ch not in HEX:
                return None
            kind, left = aux[:-1], int(aux[-1]) - 1
            return ("str", stack, kind, 0, used) if left == 0 else ("hex", stack, kind + str(left), 0, used)
        if mode == "lit":
            if ch != aux[0]:
                return None
            return ("lit", stack, aux[1:], 0, used) if len(aux) > 1 else ("after", stack, "", 0, used)
        if mode.startswith("num"):
            nxt = self._number(mode, ch)
            if nxt is not None:
                return (nxt, stack, "", 0, used)
            if mode in ("num_sign", "num_dot", "num_e", "num_esign"):  # a digit is still due
                return None
            return self.step(("after", stack, "", 0, used), ch)  # the number ended: this character follows it
        if ch in WHITESPACE:
            return None if mode == "done" or ws >= MAX_WHITESPACE_RUN else (mode, stack, aux, ws + 1, used)
        if mode == "start":
            return ("key_or_end", "o", "", 0, used) if ch == "{" else None
        if mode in ("key_or_end", "key"):
            if ch == '"':
                if self.trie is not None and stack == "o":
                    return ("rkey", stack, 0, 0, used) if self.trie.below[0] & ~used else None
                return ("str", stack, "key", 0, used)
            return self._close(stack, ch, used) if mode == "key_or_end" else None
        if mode == "colon":
            return ("value", stack, aux, 0, used) if ch == ":" else None
        if mode in ("value", "value_or_end"):
            if mode == "value_or_end" and ch == "]":
                return self._close(stack, ch, used)
            if isinstance(aux, int) and self.first[aux] is not None and ch not in self.first[aux]:
                return None
            return self._value(stack, ch, used)
        if mode == "after":
            if ch == ",":
                if stack[-1] == "a":
                    return ("value", stack, "", 0, used)
                if self.trie is not None and stack == "o" and not self.trie.below[0] & ~used:
                    return None  # every allowed key is there: only "}" may follow
                return ("key", stack, "", 0, used)
            return self._close(stack, ch, used)
        return None  # done: nothing may follow the object

    def _restricted_key(self, stack: str, node: int, used: int, ch: str):
        trie = self.trie
        if ch == '"':
            key = trie.key[node]
            return ("colon", stack, key, 0, used | 1 << key) if key >= 0 and not used >> key & 1 else None
        child = trie.children[node].get(ch)
        return ("rkey", stack, child, 0, used) if child is not None and trie.below[child] & ~used else None

    def _close(self, stack: str, ch: str, used):
        if ch != ("}" if stack[-1] == "o" else "]"):
            return None
        if stack == "o" and self.required & ~used:
            return None
        stack = stack[:-1]
        return ("after", stack, "", 0, used) if stack else ("done", "", "", 0, used)

    @staticmethod
    def _value(stack: str, ch: str, used):
        if ch == '"':
            return ("str", stack, "value", 0, used)
        if ch in "{[":
            if len(stack) >= MAX_DEPTH:
                return None
            return ("key_or_end", stack + "o", "", 0, used) if ch == "{" else ("value_or_end", stack + "a", "", 0,
                                                                              used)
        if ch == "-":
            return ("num_sign", stack, "", 0, used)
        if ch in DIGITS:
            return ("num_zero" if ch == "0" else "num_int", stack, "", 0, used)
        for word in ("true", "false", "null"):
            if ch == word[0]:
                return ("lit", stack, word[1:], 0, used)
        return None

    @staticmethod
    def _number(mode: str, ch: str):
        """Next number mode, or None when `ch` cannot continue the number."""
        digit = ch in DIGITS
        if mode == "num_sign":
            return ("num_zero" if ch == "0" else "num_int") if digit else None
        if mode in ("num_zero", "num_int"):
            if digit:
                return "num_int" if mode == "num_int" else None
            return "num_dot" if ch == "." else "num_e" if ch in "eE" else None
        if mode in ("num_dot", "num_frac"):
            return "num_frac" if digit else ("num_e" if mode == "num_frac" and ch in "eE" else None)
        if mode == "num_e":
            return "num_exp" if digit else ("num_esign" if ch in "+-" else None)
        return "num_exp" if digit else None  # num_esign, num_exp

    @classmethod
    def for_schema(cls, schema: dict | None) -> JsonObject:
        """The object a JSON Schema describes, as far as its top-level keys and their values' types go (any object
        when it names none)."""
        keys = object_keys(schema)
        if keys is None:
            return cls()
        properties = schema["properties"]
        return cls(*keys, {k: v.get("type") for k, v in properties.items() if isinstance(v, dict)})


class Alternatives:
    """Any one of several parts, followed in parallel until only one can continue. State: ((index, state), ...)
    of the alternatives still alive."""

    def __init__(self, parts: list):
        self.parts = parts
        self.start = tuple((i, p.start) for i, p in enumerate(parts))

    def step(self, state, ch: str):
        alive = tuple((i, nxt) for i, inner in state if (nxt := self.parts[i].step(inner, ch)) is not None)
        return alive or None

    def done(self, state) -> bool:
        return any(self.parts[i].done(inner) for i, inner in state)


class Sequence:
    """Parts one after another; the output is complete when every part is done. State: (part index, part state)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.start = (0, parts[0].start) if parts else (0, None)

    def step(self, state, ch: str):
        i, inner = state
        while i < len(self.parts):
            part = self.parts[i]
            nxt = part.step(inner, ch)
            if nxt is not None:
                return (i, nxt)
            if not part.done(inner):
                return None
            i += 1
            inner = self.parts[i].start if i < len(self.parts) else None
        return None

    def done(self, state) -> bool:
        i, inner = state
        if i >= len(self.parts):
            return True
        return self.parts[i].done(inner) and all(p.done(p.start) for p in self.parts[i + 1:])


def json_object_grammar(schema: dict | None = None) -> Sequence:
    return Sequence([JsonObject.for_schema(schema)])


@dataclass
class TokenTexts:
    """Each token's text as it reads after another token (so SentencePiece's leading space survives); special
    tokens are never candidates."""
    texts: list[str]
    special: frozenset[int]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenTexts:
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        base = tokenizer.decode(anchor)
        pairs = tokenizer.backend.decode_batch([anchor + [i] for i in range(tokenizer.vocab_size)],
                                               skip_special_tokens=False)
        texts = [t[len(base):] if t.startswith(base) else tokenizer.decode([i]) for i, t in enumerate(pairs)]
        special = frozenset(i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special)
        return cls(texts, special)


class GrammarProcessor:
    """Logits processor (output_ids, logits) -> logits that masks every token leaving `grammar`, and every token
    but end-of-sequence once the grammar is complete. One instance per request: it remembers the state after
    each output prefix, so speculative decoding's rolled-back drafts cost nothing extra."""

    def __init__(self, grammar, texts: TokenTexts, eos_ids: list[int], first_only: bool = False,
                 mass: float = 0.999, max_checks: int = 256):
        self.grammar = grammar
        # Greedy decoding with nothing reshaping the logits after us keeps only the argmax: one valid token will do.
        self.first_only = first_only
        self.texts = texts
        self.eos_ids = list(eos_ids)
        self.mass = mass  # stop checking once the valid tokens found hold this share of the probability
        self.max_checks = max_checks  # ...or after this many checks, once at least one token is valid
        self.ids: list[int] = []
        self.states = [grammar.start]  # states[k]: state after ids[:k]
        self.cache: dict = {}

    def state_after(self, output_ids: list[int]):
        """The grammar state after the output so far (None if the output already left the grammar)."""
        same = 0
        for a, b in zip(self.ids, output_ids):
            if a != b:
                break
            same += 1
        del self.ids[same:], self.states[same + 1:]
        for token in output_ids[same:]:
            state = self.states[-1]
            self.ids.append(token)
            self.states.append(None if state is None else self.advance(state, token))
        return self.states[-1]

    def advance(self, state, token: int):
        key = (state, token)
        if key in self.cache:
            return self.cache[key]
        text = self.texts.texts[token] if token < len(self.texts.texts) else ""
        nxt = None
        if text and token not in self.texts.special:
            nxt = state
            for ch in text:
                nxt = self.grammar.step(nxt, ch)
                if nxt is None:
                    break
        if len(self.cache) > 200_000:
            self.cache.clear()
        self.cache[key] = nxt
        return nxt

    def allowed(self, state, logits: torch.Tensor) -> list[int]:
        """Valid tokens among the likeliest, in descending logit order."""
        probs = torch.softmax(logits.float(), -1)
        n = logits.shape[-1]
        allowed, valid_mass, seen_mass, checked = [], 0.0, 0.0, 0
        for k in (64, 1024, n):
            top = torch.topk(probs, min(k, n))
            for token, p in zip(top.indices.tolist()[checked:], top.values.tolist()[checked:]):
                checked += 1
                seen_mass += p
                if self.advance(state, token) is not None:
                    if self.first_only:
                        return [token]
                    allowed.append(token)
                    valid_mass += p
                # Valid tokens not yet examined hold at most the unexamined mass.
                if allowed and (1 - seen_mass <= valid_mass * (1 - self.mass) or checked >= self.max_checks):
                    return allowed
            if checked >= n:
                break
        return allowed

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        state = self.state_after(output_ids)
        if state is None:  # cannot happen when every position was processed; leave the logits alone
            return logits
        keep = self.eos_ids if self.grammar.done(state) else self.allowed(state, logits)
        if not keep:  # ending here would hand back output that breaks the grammar as if it were complete
            raise InvalidRequestError("the output cannot continue: no token of the vocabulary follows the required "
                                      "format from here (a key may need characters the model cannot write)")
        masked = torch.full_like(logits, -math.inf)
        index = torch.tensor(keep, dtype=torch.long)
        masked[index] = logits[index]
        return masked

