"""Constrained decoding on llguidance: a request's grammar (a JSON Schema, a Lark grammar, a regex, or a tool-call
format's grammar) is compiled for the model's vocabulary, and a logits processor masks every token the grammar does
not allow next.

A step checks the token the model picks and computes a mask only when the grammar refuses it (GrammarProcessor).
Speculative drafts are cut at the first token the grammar refuses (`draft_prefix`), so no branch that cannot be
kept is verified.
"""
from __future__ import annotations

import json
import math
import threading

import llguidance
import numpy as np
import torch

from fastdecode.errors import InvalidRequestError

MAX_SOURCE_CHARS = 1_000_000  # a grammar or a schema as text: a bound on compiling it, far past any real one
# llguidance's own bounds on what a grammar may cost: its size, and the lexer and parser work of each token.
LIMITS = dict(max_grammar_size=500_000, max_lexer_states=250_000, initial_lexer_fuel=1_000_000,
              step_lexer_fuel=200_000, step_max_items=50_000, max_items_in_row=2_000)
# JSON as OpenAI's structured outputs write it: no whitespace but one space after ':' and ','. Free whitespace lets
# a small model loop on blank lines until max_tokens. \uXXXX escapes of any character are JSON too.
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
                "json_allow_general_unicode_escapes": True}


def json_schema_grammar(schema: dict | bool | None, strict: bool = True) -> str:
    """A JSON value that `schema` accepts; any JSON object when there is none. `strict` False: keywords llguidance
    does not implement are ignored (a tool's loose schema) instead of refused."""
    if schema is None:
        schema = {"type": "object"}
    options = dict(JSON_OPTIONS, lenient=not strict)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except ValueError as e:
        raise InvalidRequestError(f"the JSON schema cannot be read: {e}") from None


def lark_json(schema: dict | bool | None, strict: bool = True, compact: bool = False) -> str:
    """`schema` as an inline `%json` rule of a Lark grammar, its JSON written as JSON_OPTIONS says, `{"a": 1}`, or
    `{"a":1}` when `compact` (see json_schema_grammar for `strict`)."""
    if schema is None or schema is True:
        schema = {"type": "object"} if schema is None else {}
    elif schema is False:
        schema = {"not": {}}
    options = dict(JSON_OPTIONS, lenient=not strict)
    if compact:
        options.update(item_separator=",", key_separator=":")
    return "%json " + json.dumps({**schema, "x-guidance": options})


def lark_grammar(text: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(text)


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


class GrammarCompiler:
    """Matchers for one vocabulary. Thread-safe: requests are prepared on the server's worker threads, never on the
    engine's. Each request compiles its own matcher (about 2 ms for a tool set, 0.5 ms for a schema): a compiled
    grammar shared between requests shares its lexer's states, which grow with every request's text until
    llguidance's limit refuses them all."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.vocabularies: dict[tuple[int, ...], llguidance.LLTokenizer] = {}

    def vocabulary(self, eos: tuple[int, ...]) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, with `eos` the tokens that end a reply (a grammar cannot spell
        them: they end it), built on first use (1.3 s for Gemma 3's 262k tokens). It reads the tokenizer's own
        pipeline, so every kind we load (GGUF BPE and SentencePiece, tokenizer.json) maps each token to the bytes
        our detokenizer gives it."""
        with self.lock:
            if eos not in self.vocabularies:
                backend = self.tokenizer.backend
                self.vocabularies[eos] = llguidance.LLTokenizer(backend.to_str(), n_vocab=backend.get_vocab_size(),
                                                                eos_token=list(eos))
            return self.vocabularies[eos]

    def matcher(self, grammar: str, eos: list[int] | None = None, what: str = "the grammar") -> llguidance.LLMatcher:
        """A matcher at the start of `grammar`, ending at `eos` (the tokenizer's end-of-sequence tokens when None);
        InvalidRequestError naming what is wrong with the grammar."""
        if len(grammar) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(f"{what} is longer than {MAX_SOURCE_CHARS:,} characters")
        eos = tuple(self.tokenizer.eos_token_ids if eos is None else eos)
        # Compiling drops the GIL; LIMITS bound its work.
        try:
            matcher = llguidance.LLMatcher(self.vocabulary(eos), grammar, log_level=0,
                                           limits=llguidance.LLParserLimits(**LIMITS))
        except UnicodeError:  # a lone surrogate, which JSON can spell
            raise InvalidRequestError(f"{what} is not valid Unicode: it holds a lone surrogate") from None
        if matcher.is_error():
            raise InvalidRequestError(f"{what}: {one_line(matcher.get_error())}")
        return matcher

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.backend.get_vocab_size()


def one_line(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."


class GrammarProcessor:
    """Logits processor (output_ids, logits) -> logits that keeps only the tokens `matcher` allows next: the
    grammar's, then end-of-sequence (`eos`) once it is complete. `bias` (vocab,), a request's logit_bias, is added
    first, so the grammar picks among the biased logits.

    A mask walks the whole vocabulary (9 us a token in JSON, up to tens of milliseconds in the free text of a tool
    grammar with 49k tokens), while checking one token costs a few microseconds: Sampler draws from the unmasked
    logits (`unmasked`), keeps the token when the grammar `accepts` it, and only otherwise draws again from the masked
    ones. Either way the token comes from the masked distribution (for t allowed: p(t) + (1 - p(A)) p(t) / p(A) =
    p(t) / p(A)), and greedy output is the model's own wherever the grammar allows it.

    One instance per request. It follows the output it is shown: tokens past what it consumed are consumed, tokens
    rolled back (speculative decoding) are rolled back."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: list[int],
                 bias: torch.Tensor | None = None, source: str | None = None):
        self.matcher = matcher
        self.source = source  # the grammar the matcher was compiled from: a cluster's replica compiles it again
        self.vocab_size = vocab_size
        self.eos = frozenset(eos)
        self.bias = bias
        self.consumed: list[int] = []
        self.mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)

    def sync(self, output_ids: list[int]):
        """Brings the matcher to the state after `output_ids`."""
        same = 0
        for a, b in zip(self.consumed, output_ids):
            if a != b:
                break
            same += 1
        if same < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - same)
            del self.consumed[same:]
        for token in output_ids[same:]:
            if not self.matcher.consume_token(token):
                raise InvalidRequestError(f"the output left the grammar: {one_line(self.matcher.get_error())}")
            self.consumed.append(token)

    def unmasked(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.bias is None else logits + self.bias

    def accepts(self, output_ids: list[int], token: int) -> bool:
        """Whether the grammar allows `token` after `output_ids`."""
        self.sync(output_ids)
        if token in self.eos:
            return self.matcher.is_accepting()
        return 0 <= token < self.vocab_size and self.matcher.validate_tokens([token]) == 1

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.sync(output_ids)
        view = self.mask[0]
        self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        if self.matcher.is_error():
            raise InvalidRequestError(f"the output cannot follow the grammar: {one_line(self.matcher.get_error())}")
        bits = np.unpackbits(self.mask.numpy().view(np.uint8), bitorder="little")
        n = min(self.vocab_size, logits.shape[-1])
        allowed = torch.from_numpy(bits[:n].view(np.bool_))
        if not bool(allowed.any()):
            # Ending here would hand back output that breaks the grammar as if it were complete.
            raise InvalidRequestError("the output cannot continue: no token of the vocabulary follows the grammar "
                                      "from here")
        masked = torch.full_like(logits, -math.inf)
        masked[:n] = self.unmasked(logits)[:n].masked_fill(~allowed, -math.inf)
        return masked

    def draft_prefix(self, output_ids: list[int], tokens: list[int]) -> int:
        """How many of `tokens`, drafted to follow `output_ids`, the grammar allows in a row."""
        self.sync(output_ids)
        return self.matcher.validate_tokens(tokens)
