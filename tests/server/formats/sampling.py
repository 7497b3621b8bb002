"""Random replies that a grammar allows: each token drawn from the matcher's mask, biased so that replies end (an
end-of-sequence token, or a token that closes something, is taken at times) and now and then steered through a
hint (a marker the format opens or closes with, which a vocabulary may only spell in several tokens)."""
from __future__ import annotations

import numpy as np

from fastdecode.server.formats.lark import vocabulary_tokens

P_END, P_CLOSE, P_HINT = 0.25, 0.3, 0.08
CLOSING = set('"}]\n')


class Vocabulary:
    """A tokenizer's token texts, and as masks (vocab,) its end-of-sequence tokens and the tokens the sampler takes
    at times: added tokens (the formats' markers) and those that close a string, an object, an array or a line."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.size = tokenizer.backend.get_vocab_size()
        self.texts = [tokenizer.decode([i]) for i in range(self.size)]
        self.eos = np.zeros(self.size, bool)
        self.eos[tokenizer.eos_token_ids] = True
        self.closers = np.array([bool(t) and set(t) <= CLOSING for t in self.texts])
        self.closers[list(vocabulary_tokens(tokenizer).values())] = True
        self.spellings: dict[str, np.ndarray] = {}

    def decode(self, ids: list[int]) -> str:
        """The reply's text as its parser sees it: special tokens kept, the token that ended it dropped."""
        if ids and self.eos[ids[-1]]:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def spelling(self, text: str) -> np.ndarray:
        """(vocab,) mask of the tokens whose text begins `text`."""
        if text not in self.spellings:
            self.spellings[text] = np.array([bool(t) and text.startswith(t) for t in self.texts])
        return self.spellings[text]


def sample(matcher, vocab: Vocabulary, rng: np.random.Generator, max_tokens: int, hints=()) -> tuple[list[int], bool]:
    """(a reply's tokens, whether it ended before max_tokens): tokens the grammar allows, drawn as the module says."""
    ids, hint = [], ""
    while len(ids) < max_tokens and not matcher.is_stopped():
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        allowed = bits[:vocab.size].astype(bool)
        assert allowed.any(), f"a dead end after {vocab.tokenizer.decode(ids)!r}"
        if not hint and hints and rng.random() < P_HINT:
            hint = hints[rng.integers(len(hints))]
        fits = np.flatnonzero(allowed & vocab.spelling(hint)) if hint else ()
        if len(fits):  # the longest allowed token that spells the hint on
            token = max(fits, key=lambda t: len(vocab.texts[t]))
            hint = hint[len(vocab.texts[token]):]
        else:
            hint = ""
            ends, closers = np.flatnonzero(allowed & vocab.eos), np.flatnonzero(allowed & vocab.closers)
            if len(ends) and rng.random() < P_END:
                token = rng.choice(ends)
            elif len(closers) and rng.random() < P_CLOSE:
                token = rng.choice(closers)
            else:
                token = rng.choice(np.flatnonzero(allowed))
        assert matcher.consume_token(int(token)), matcher.get_error()
        ids.append(int(token))
        if vocab.eos[token]:
            return ids, True
    return ids, matcher.is_stopped()
