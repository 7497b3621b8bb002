"""A draft: a token tree rooted at the last accepted token (a chain is a tree with one child per node)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    """Nodes in topological order (a parent before its children). Node i holds tokens[i], hangs under parents[i]
    (-1: under the root, the last accepted token, which is not a node) and carries the drafter's estimate scores[i]
    that its whole path is accepted. q (n, vocab), when set, holds the distribution each token was *sampled* from
    (a stochastic drafter); without it a drafter is deterministic (a one-hot q)."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    q: torch.Tensor | None = None
    drafter: str = ""

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(cls, tokens: list[int], scores: list[float], q=None, drafter: str = "") -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), list(scores), q, drafter)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """1 for the root's children."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> list[dict[int, int]]:
        """For the root (index 0) and every node (index i + 1): token -> child node index + 1."""
        out: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for i, (token, p) in enumerate(zip(self.tokens, self.parents)):
            out[p + 1].setdefault(token, i + 1)
        return out

    def subset(self, keep: list[int]) -> "Draft":
        """The nodes `keep` (their ancestors must be kept too), renumbered in the same order."""
        keep = sorted(keep)
        index = {old: new for new, old in enumerate(keep)}
        q = self.q[keep] if self.q is not None else None
        return Draft([self.tokens[i] for i in keep], [index[self.parents[i]] if self.parents[i] >= 0 else -1
                                                      for i in keep], [self.scores[i] for i in keep], q, self.drafter)

    def allowed(self, prefix_allowed) -> "Draft | None":
        """The nodes whose whole path from the root a grammar allows, or None when it allows none.
        `prefix_allowed(tokens)`: how many of `tokens`, from the root on, the grammar allows in a row."""
        if self.is_chain:
            keep = list(range(prefix_allowed(self.tokens)))
        else:
            paths: list[list[int]] = []
            for token, p in zip(self.tokens, self.parents):
                paths.append((paths[p] if p >= 0 else []) + [token])
            keep = [i for i, path in enumerate(paths) if prefix_allowed(path) == len(path)]
        if len(keep) == len(self):
            return self
        return self.subset(keep) if keep else None

    def tree_inputs(self, root_token: int, root_pos: int) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """-> (tokens (T,), positions (T,), ancestor mask (T, T) or None for a chain) with the root as token 0."""
        tokens = [root_token] + self.tokens
        positions = torch.tensor([root_pos] + [root_pos + d for d in self.depths()], dtype=torch.long)
        if self.is_chain:
            return tokens, positions, None
        T = len(tokens)
        mask = torch.zeros(T, T, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            if p >= 0:
                mask[row] = mask[p + 1]
            mask[row, row] = True
        return tokens, positions, mask
