"""The verifier's acceptance rule: which drafted tokens the target keeps, given its logits at every tree node.

Vocabulary (as in vLLM's rejection sampler): a draft token the target keeps is *accepted*; the token the target
draws where it rejects a draft is *recovered*; the token it draws after the last accepted node when that node has
no children left to check is the *bonus* token. Each verify step therefore emits its accepted tokens plus exactly
one recovered or bonus token.

Deterministic drafters (n-gram, suffix, greedy model drafts) have a one-hot q. For them the rule of Leviathan et al.
(2023) and Chen et al. (2023) -- accept d with probability min(1, p(d) / q(d)), else draw from norm(max(0, p - q))
-- reduces to: draw y ~ p exactly as plain decoding would; accept the child whose token is y, if any. That form also
verifies a tree (SpecInfer's multi-candidate rule for one-hot drafts) and draws from the same sampler, with the same
penalties and logits processors, as plain decoding. A stochastic drafter (q given) uses the general rule on a chain.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastdecode.engine.sampling import Sampler, draw
from fastdecode.speculative.draft import Draft


@dataclass
class Verdict:
    tokens: list[int]  # emitted: the accepted draft tokens, then one recovered or bonus token
    path: list[int]  # the accepted nodes' indices in the draft
    bonus: bool  # the last token is a bonus token (every draft token on the path was accepted)


def verify(draft: Draft, logits: torch.Tensor, sampler: Sampler, stop_ids: set[int]) -> Verdict:
    """logits (1 + len(draft), vocab): row 0 for the root, row i + 1 for node i. Accepts tokens into the sampler
    as it goes, so every draw sees exactly the tokens before it; stops after a stop token."""
    if draft.q is not None:
        return verify_stochastic_chain(draft, logits, sampler, stop_ids)
    children = draft.children()
    row, tokens, path = 0, [], []
    while True:
        y = sampler.sample(logits[row])
        sampler.accept(y, logits[row])
        tokens.append(y)
        child = children[row].get(y)
        if child is None or y in stop_ids:
            return Verdict(tokens, path, bonus=not children[row])
        path.append(child - 1)
        row = child


def verify_stochastic_chain(draft: Draft, logits: torch.Tensor, sampler: Sampler, stop_ids: set[int]) -> Verdict:
    """The general rule for a chain drawn from q (n, vocab)."""
    tokens, path = [], []
    for i, d in enumerate(draft.tokens):
        p = sampler.probs(logits[i])
        q = draft.q[i]
        # Accept with probability min(1, p/q): then the token is distributed as min(p, q) / P(accept) ...
        if torch.rand((), generator=sampler.generator) * q[d] < p[d]:
            sampler.accept(d, logits[i])
            tokens.append(d)
            path.append(i)
            if d in stop_ids:
                return Verdict(tokens, path, bonus=False)
            continue
        # ... and on rejection from norm(max(0, p - q)), which makes the emitted token exactly p-distributed.
        residual = (p - q).clamp_(min=0)
        residual = residual if residual.sum() > 0 else p
        y = draw(residual, sampler.generator)
        sampler.accept(y, logits[i])
        return Verdict(tokens + [y], path, bonus=False)
    y = sampler.sample(logits[len(draft)])
    sampler.accept(y, logits[len(draft)])
    return Verdict(tokens + [y], path, bonus=True)
