"""Incremental detokenization: text deltas from a growing token list, never splitting a UTF-8 character, and
stop strings held back until they can no longer be the start of a match."""
from __future__ import annotations

# Prompt tokens decoded with the output so that tokenizers that strip a leading space decode the first output
# token as they would in context.
CONTEXT_TOKENS = 4


class StopMatcher:
    """Aho-Corasick automaton over the stop strings, fed the output one character at a time. After each character
    it knows the longest tail of the text that is the start of some stop string (the text to hold back) and whether
    a stop string just ended, in amortised constant work per character however long and many the strings are."""

    def __init__(self, stop: list[str]):
        self.goto: list[dict[str, int]] = [{}]  # trie edges; node 0 is the empty prefix
        self.depth = [0]  # length of the prefix a node spells
        self.fail = [0]  # the node of its longest proper suffix that is also in the trie
        self.ends = [0]  # length of the longest stop string that ends the node's prefix (0: none)
        for s in stop:
            node = 0
            for ch in s:
                if ch not in self.goto[node]:
                    self.goto[node][ch] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.fail.append(0)
                    self.ends.append(0)
                node = self.goto[node][ch]
            self.ends[node] = len(s)
        order = list(self.goto[0].values())  # breadth-first, so a node's fail target is final before its own
        for node in order:
            for ch, child in self.goto[node].items():
                order.append(child)
                self.fail[child] = self._next(self.fail[node], ch) if node else 0
                self.ends[child] = self.ends[child] or self.ends[self.fail[child]]
        self.state = 0

    def _next(self, node: int, ch: str) -> int:
        while node and ch not in self.goto[node]:
            node = self.fail[node]
        return self.goto[node].get(ch, 0)

    def feed(self, ch: str) -> int:
        """Advances over `ch`; returns the length of the longest stop string ending here, or 0."""
        self.state = self._next(self.state, ch)
        return self.ends[self.state]

    @property
    def held(self) -> int:
        """Characters at the end of the text that could still grow into a stop string."""
        return self.depth[self.state]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], keep: list[int] | None = None):
        """`keep`: special token ids whose text stays in the output; the others are skipped."""
        self.tokenizer = tokenizer
        self.keep = {"keep": set(keep)} if keep else {}  # decode's extra argument; none for most requests
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = StopMatcher(stop)
        self.text = ""  # all output text decoded so far (up to a stop string, once one is found)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Adds one output token and returns the text that is now safe to emit."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True, **self.keep)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True, **self.keep)
        if len(full) > len(prefix) and not full.endswith("\ufffd") and not self.stopped:  # U+FFFD: half a char
            self._extend(full[len(prefix):])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        end = len(self.text) if self.stopped else len(self.text) - self.stop.held
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta

    def _extend(self, new: str):
        """Appends `new`, cut at the first stop string that completes inside it."""
        for i, ch in enumerate(new):
            length = self.stop.feed(ch)
            if length:
                self.text = (self.text + new[:i + 1])[:-length]
                self.stopped = True
                return
        self.text += new

    def flush(self) -> str:
        """At the end of generation: whatever was held back (an unfinished stop-string prefix) is text."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
