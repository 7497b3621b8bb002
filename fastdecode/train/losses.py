"""The training forward of each head kind, with EAGLE-3's training-time test.

Notation for one window of a sequence (T tokens c_0..c_{T-1}): the target's taps f_j and its greedy prediction y_j
after position j (the token it would emit after c_0..c_j). The head's entry j reads (f_j, c_{j+1}) and must predict
y_{j+1}, the token after next: that is step 1. At draft time the head then feeds itself: step k reads its own step
k-1 output at anchor j with the token c_{j+k} and predicts y_{j+k}, attending to the real entries 0..j and to its own
earlier steps at the same anchor only (what a drafted chain sees). Step k at anchor j counts only when the text
follows the target there (c_{j+i+1} = y_{j+i} for i < k), since a draft only continues along accepted tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def step_targets(ids: torch.Tensor, preds: torch.Tensor, steps: int):
    """ids, preds (B, T) -> per step k = 1..steps: (labels (B, T - 1), valid (B, T - 1)) for anchors j = 0..T-2;
    label y_{j+k}, valid while the text has followed the target and j + k < T."""
    B, T = ids.shape
    out, valid = [], torch.ones(B, T - 1, dtype=torch.bool)
    for k in range(1, steps + 1):
        labels = torch.zeros(B, T - 1, dtype=torch.long)
        n = T - k  # anchors with a label at j + k
        if n <= 0:
            out.append((labels, torch.zeros_like(valid)))
            continue
        labels[:, :n] = preds[:, k:k + n].long()  # padding carries -1
        if k > 1:
            follows = torch.zeros(B, T - 1, dtype=torch.bool)
            follows[:, :n] = ids[:, k:k + n] == preds[:, k - 1:k - 1 + n]
            valid = valid & follows
        in_range = torch.zeros(B, T - 1, dtype=torch.bool)
        in_range[:, :n] = True
        valid = valid & in_range & (labels >= 0)
        out.append((labels.clamp(min=0), valid.clone()))
    return out


def eagle_logits(head, embed, taps, ids, steps: int, rope: torch.Tensor) -> list[torch.Tensor]:
    """taps (B, T, n D), ids (B, T) -> per step, draft-vocabulary logits (B, T - 1, V) at anchors 0..T-2."""
    B, T = ids.shape
    n = T - 1
    H, K, hd = head.H, head.K, head.hd
    feature = head.fuse(taps[:, :n].float())
    k_real = v_real = None
    extra_k, extra_v, out = [], [], []
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for k in range(1, steps + 1):
        tok = torch.zeros(B, n, dtype=torch.long)
        tok[:, :T - k] = ids[:, k:].long()
        pos = torch.arange(n) + (k - 1)
        q, kk, vv = head.qkv(feature, embed(tok), rope[0, pos], rope[1, pos])
        kk, vv = kk.repeat_interleave(H // K, 1), vv.repeat_interleave(H // K, 1)  # (B, H, n, hd)
        if k == 1:
            k_real, v_real = kk, vv
            y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, scale=hd ** -0.5)
        else:
            extra_k.append(kk)
            extra_v.append(vv)
            s_real = (q @ k_real.transpose(-1, -2)) * hd ** -0.5  # (B, H, n, n)
            s_real = s_real.masked_fill(~causal, float("-inf"))
            s_own = torch.stack([(q * e).sum(-1) for e in extra_k], -1) * hd ** -0.5  # (B, H, n, k - 1)
            w = torch.softmax(torch.cat([s_real, s_own], -1), -1)
            y = w[..., :n] @ v_real + (w[..., n:].unsqueeze(-1) * torch.stack(extra_v, -2)).sum(-2)
        feature = head.finish(feature, y)
        out.append(head.lm_head(feature))
    return out


def mtp_logits(head, embed, taps, ids, steps: int, rope=None) -> list[torch.Tensor]:
    """-> per head k = 1..depth, logits (B, T - 1, V) at anchors 0..T-2 (all heads in one pass)."""
    n = ids.shape[1] - 1
    logits = head(taps[:, :n].float(), embed(ids[:, 1:].long()))  # (B, n, depth, V)
    return [logits[:, :, k] for k in range(min(steps, logits.shape[2]))]


def head_loss(step_logits, targets, to_draft: torch.Tensor, decay: float = 0.8):
    """Cross-entropy per step over the valid anchors whose label is in the draft vocabulary, steps weighted by
    decay^(k-1) (EAGLE-3's schedule) -> (loss, per step (correct, counted) of top-1)."""
    loss, stats = 0.0, []
    for k, (logits, (labels, valid)) in enumerate(zip(step_logits, targets)):
        d = to_draft[labels]
        mask = valid & (d >= 0)
        if mask.any():
            loss = loss + decay ** k * F.cross_entropy(logits[mask], d[mask])
        correct = (logits.argmax(-1) == d) & mask
        stats.append((correct, mask))
    return loss, stats


def accepted_length(stats) -> tuple[float, list[float]]:
    """From per-step (correct, counted) masks: mean length of the leading run of correct steps over anchors where
    step 1 counts (a greedy chain's accepted tokens when the head's features are its own), and per-step accuracy."""
    base = stats[0][1]
    run = torch.ones_like(base)
    total = torch.zeros(base.shape, dtype=torch.float32)
    for correct, _ in stats:
        run = run & correct
        total += run.float()
    n = base.sum().item()
    return (total[base].sum().item() / n if n else 0.0,
            [(c.sum() / m.sum()).item() if m.any() else 0.0 for c, m in stats])
