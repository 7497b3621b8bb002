"""Drafters over a trained head: EAGLE chains and dynamic trees (EAGLE-2), and multi-token-prediction trees.

The speculator hands a feature drafter the target's taps for every token it accepted (observe_features); the
drafter keeps them pending until it is asked to propose, so steps it sits out cost it nothing. A long prompt's taps
(a 20k-token agent prompt: 20k rows of n_taps x hidden floats, half a GB at 2k wide) do not wait: an EAGLE head takes
them into its cache as they come, past EAGER_ROWS; an MTP head keeps only the last row, all it reads.

EAGLE-2's dynamic tree (Li et al., 2024): the head's probabilities are well calibrated, so the tree grows where the
head is confident. At every depth the `top_k` nodes with the highest path probability (the product of the head's
probabilities along the path) are expanded in one batched head forward, each giving `top_k` children; finally the
`budget` nodes with the highest path probability over all depths are the draft (a child never scores above its
parent, so the kept nodes form a tree). The scores are those path probabilities; the policy calibrates them.
"""
from __future__ import annotations

import heapq

import torch
import torch.nn.functional as F

from fastdecode.speculative.draft import Draft
from fastdecode.speculative.drafter import Drafter


class FeatureDrafter(Drafter):
    """A drafter that reads the target's taps: `feature_layers` tells the speculator which to capture."""
    model_free = False

    def __init__(self, head, cfg, model, name: str):
        self.head, self.cfg, self.model, self.name = head, cfg, model, name
        self.feature_layers = cfg.taps
        self.pending: list[tuple[int, torch.Tensor]] = []  # (first position, taps (m, n_taps * D))
        self.prompt: list[int] = []

    def start(self, prompt_ids, params=None):
        self.pending, self.prompt = [], list(prompt_ids)

    def observe_features(self, pos: int, taps: torch.Tensor):
        """taps (m, n_taps * D) of the tokens at positions pos..pos+m-1, as the target computed them. Taps that do
        not follow the pending ones (a preempted request computes its tokens again) replace them."""
        if self.pending and pos != self.pending[-1][0] + self.pending[-1][1].shape[0]:
            self.pending = []
        self.pending.append((pos, taps))

    def take_pending(self, upto: int) -> tuple[int, torch.Tensor] | None:
        """Pending taps joined, for positions up to `upto` (inclusive) -> (first position, taps) or None; later
        ones stay pending."""
        if not self.pending:
            return None
        first = self.pending[0][0]
        joined = torch.cat([t for _, t in self.pending], 0)
        taps, rest = joined[:upto - first + 1], joined[upto - first + 1:]
        self.pending = [(first + taps.shape[0], rest)] if rest.shape[0] else []
        return (first, taps) if taps.shape[0] else None

    def pending_rows(self) -> int:
        return sum(t.shape[0] for _, t in self.pending)

    def to_vocab(self, ids: torch.Tensor) -> list[int]:
        return self.head.lm_head.draft_ids[ids].tolist()


class EagleDrafter(FeatureDrafter):
    EAGER_ROWS = 256  # pending prompt taps past which the head's cache takes them at once

    def __init__(self, head, cfg, model, rope: torch.Tensor, top_k: int = 8, depth: int = 5,
                 min_score: float = 0.02, name: str = "eagle"):
        """rope: the head's rotary table (shared by every request's drafter). top_k 1: a chain. min_score: a node
        whose path probability falls below it is not expanded."""
        super().__init__(head, cfg, model, name)
        self.top_k, self.depth, self.min_score = top_k, depth, min_score
        self.scratch = depth * top_k + 1  # cache slots for draft entries after the real ones
        self.rope = rope
        self.k = self.v = None
        # Real entries (the target's own features) at positions base..real-1, in cache slots 0..real-base-1: a
        # request whose prompt was partly a prefix-cache hit has no taps before its first computed position.
        self.base = self.real = 0
        self.last: torch.Tensor | None = None  # the head's output at the last real entry (1, D)

    def start(self, prompt_ids, params=None):
        super().start(prompt_ids, params)
        slots = len(prompt_ids) + (params.max_tokens if params is not None else 0) + self.scratch
        self.k = torch.zeros(1, self.cfg.num_key_value_heads, min(slots, self.rope.shape[1]), self.cfg.head_dim)
        self.v = torch.zeros_like(self.k)
        self.base = self.real = 0
        self.last = None

    def observe_features(self, pos: int, taps: torch.Tensor):
        """Past EAGER_ROWS pending, the taps of prompt positions whose next token the prompt holds go into the
        head's cache now (the same entries catch_up writes when asked to propose)."""
        super().observe_features(pos, taps)
        if self.k is not None and self.pending_rows() >= self.EAGER_ROWS and len(self.prompt) >= 2:
            with torch.inference_mode():
                self.catch_up(self.prompt[:min(pos + taps.shape[0], len(self.prompt) - 1) + 1])

    def attend(self, feature, tokens, positions, slots: slice, mask):
        """Head forward over entries (feature (T, D), token) at positions, written to `slots` -> output (T, D)."""
        emb = self.model.embed(torch.tensor(tokens)).unsqueeze(0)
        cos, sin = self.rope[0, positions], self.rope[1, positions]
        q, k, v = self.head.qkv(feature.unsqueeze(0), emb, cos, sin)
        self.k[:, :, slots], self.v[:, :, slots] = k, v
        end = slots.stop
        y = F.scaled_dot_product_attention(q, self.k[:, :, :end], self.v[:, :, :end], attn_mask=mask,
                                           scale=self.cfg.head_dim ** -0.5, enable_gqa=True)
        return self.head.finish(feature.unsqueeze(0), y)[0]

    def catch_up(self, context: list[int]):
        """Writes the real entries (taps of position j, token j + 1) for j up to len(context) - 2."""
        upto = len(context) - 2
        pending = self.take_pending(upto)
        if pending is None:
            return
        first, taps = pending
        if first != self.real:  # a prefix-cache hit or a recomputed request: start over from these taps
            self.base = self.real = first
        T, slot = taps.shape[0], first - self.base
        positions = torch.arange(first, first + T)
        mask = None
        if T > 1:
            mask = torch.ones(T, slot + T, dtype=torch.bool).tril(slot)
        out = self.attend(self.head.fuse(taps), context[first + 1:first + 1 + T], positions, slice(slot, slot + T),
                          mask)
        self.real, self.last = first + T, out[-1:]

    @torch.inference_mode()
    def propose(self, context: list[int], budget: int, promising=None) -> Draft | None:
        self.catch_up(context)
        if self.last is None or self.real != len(context) - 1:
            return None
        root_pos = len(context) - 2  # position of the last real entry; draft depth d sits at root_pos + d
        probs = torch.softmax(self.head.lm_head(self.last)[0].float(), -1)
        p, ids = probs.topk(self.top_k)
        tokens, parents, scores, depths = self.to_vocab(ids), [-1] * self.top_k, p.tolist(), [1] * self.top_k
        hidden = [self.last[0]] * self.top_k  # the head output each node was predicted from
        slot_of: dict[int, int] = {}  # expanded node -> its cache slot
        level = list(range(self.top_k))
        real = self.real - self.base  # slots of real entries
        free = real  # next scratch slot
        for d in range(1, self.depth):
            expand = sorted(level, key=lambda i: -scores[i])[:self.top_k]
            expand = [i for i in expand if scores[i] >= self.min_score]
            if not expand:
                break
            n = len(expand)
            slots = slice(free, free + n)
            mask = torch.zeros(n, free + n, dtype=torch.bool)
            mask[:, :real] = True
            for row, i in enumerate(expand):
                slot_of[i] = free + row
                a = i
                while a >= 0:
                    if a in slot_of:
                        mask[row, slot_of[a]] = True
                    a = parents[a]
            out = self.attend(torch.stack([hidden[i] for i in expand]), [tokens[i] for i in expand],
                              torch.full((n,), root_pos + d), slots, mask)
            free += n
            cp, cids = torch.softmax(self.head.lm_head(out).float(), -1).topk(self.top_k)  # (n, top_k)
            level = []
            for row, i in enumerate(expand):
                for tok, pr in zip(self.to_vocab(cids[row]), cp[row].tolist()):
                    level.append(len(tokens))
                    tokens.append(tok)
                    parents.append(i)
                    scores.append(scores[i] * pr)
                    depths.append(d + 1)
                    hidden.append(out[row])
        # A child never scores above its parent (a product of probabilities), and a tie goes to the shallower node:
        # the kept nodes are a tree.
        keep = sorted(range(len(tokens)), key=lambda i: (-scores[i], depths[i]))[:budget]
        return Draft(tokens, parents, scores, drafter=self.name).subset(keep) or None


class MTPDrafter(FeatureDrafter):
    """k heads, one pass, from the last real taps and the root token: a chain of each head's top token, or a tree
    that grows best-first over the heads' independent top-k (Medusa's tree: a node's children at depth i are head
    i's candidates, scored by the product along the path)."""

    def __init__(self, head, cfg, model, top_k: int = 4, name: str = "mtp"):
        super().__init__(head, cfg, model, name)
        self.top_k = top_k
        self.last_taps: torch.Tensor | None = None
        self.real = 0

    def start(self, prompt_ids, params=None):
        super().start(prompt_ids, params)
        self.last_taps, self.real = None, 0

    def observe_features(self, pos: int, taps: torch.Tensor):
        """Only the last row is ever read: it replaces whatever was pending."""
        self.pending = [(pos + taps.shape[0] - 1, taps[-1:])]

    @torch.inference_mode()
    def propose(self, context: list[int], budget: int, promising=None) -> Draft | None:
        pending = self.take_pending(len(context) - 2)
        if pending is not None:
            first, taps = pending
            self.last_taps, self.real = taps[-1], first + taps.shape[0]
        if self.last_taps is None or self.real != len(context) - 1:
            return None
        emb = self.model.embed(torch.tensor(context[-1]))
        probs = torch.softmax(self.head(self.last_taps[None], emb[None])[0].float(), -1)  # (depth, draft vocab)
        p, ids = probs.topk(self.top_k, -1)
        cand = [(self.to_vocab(ids[d]), p[d].tolist()) for d in range(probs.shape[0])]  # per depth, best first
        draft = Draft(drafter=self.name)
        # Best-first, lazily: popping a node pushes its next sibling and its first child, which is enough because
        # each head's candidates are sorted.
        heap = [(-cand[0][1][0], -1, 0, 0)]  # (-path probability, parent node, depth index, rank in cand)
        while heap and len(draft) < budget:
            neg, parent, d, r = heapq.heappop(heap)
            i = draft.add(cand[d][0][r], parent, -neg)
            parent_score = draft.scores[parent] if parent >= 0 else 1.0
            if r + 1 < len(cand[d][0]):
                heapq.heappush(heap, (-parent_score * cand[d][1][r + 1], parent, d, r + 1))
            if d + 1 < len(cand):
                heapq.heappush(heap, (neg * cand[d + 1][1][0], i, d + 1, 0))
        return draft or None
