"""Prompt lookup: find the longest suffix of the context (n tokens, n from max_n down to min_n) that occurred
before in the prompt or output, and propose the tokens that followed its most recent occurrence."""
from __future__ import annotations

from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, max_depth: int = 16):
        self.max_n, self.min_n, self.max_depth = max_n, min_n, max_depth
        self.last: dict[tuple, int] = {}  # n-gram -> end index (exclusive) of its latest occurrence
        self.indexed = 0  # context[:indexed] is in `last`

    def start(self, prompt_ids: list[int], params=None):
        self.last, self.indexed = {}, 0

    def _index(self, context: list[int]):
        # An n-gram ending at e (exclusive) is indexed once the token at e exists, so a lookup of the current
        # suffix never finds itself and every match has at least one token after it.
        for e in range(max(self.indexed, 1), len(context)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.last[tuple(context[e - n:e])] = e
        self.indexed = max(self.indexed, len(context))

    def match(self, context: list[int]) -> tuple[int, int]:
        """-> (n, end) of the longest matching suffix, or (0, -1)."""
        self._index(context)
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            end = self.last.get(tuple(context[-n:]))
            if end is not None:
                return n, end
        return 0, -1

    def propose(self, context: list[int], budget: int, promising=None) -> Draft | None:
        n, end = self.match(context)
        # A longer match predicts better; the policy calibrates these ranks against what was accepted.
        base = n / (n + 1)
        if not n or (promising is not None and not promising(base)):
            return None
        tokens = context[end:end + min(budget, self.max_depth)]
        return Draft.chain(tokens, [base ** (d + 1) for d in range(len(tokens))], drafter=self.name) if tokens else None
