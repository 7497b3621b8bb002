"""The target's forward passes, with the residual streams after a few layers ("taps") captured on the way: what a
feature-reading drafter (EAGLE, MTP) consumes. Capturing changes no arithmetic, so logits stay bit for bit those of
the plain forward (the verify step stays lossless)."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from fastdecode.engine.generate import prefill


@contextmanager
def capture(model, taps: list[int]):
    """While open, every PyTorch forward of the model appends each tap layer's output (B, T, D) to out[i]."""
    out: list[list[torch.Tensor]] = [[] for _ in taps]
    hooks = [model.layers[t].register_forward_hook(lambda m, i, o, k=k: out[k].append(o)) for k, t in enumerate(taps)]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


@torch.inference_mode()
def forward_taps(model, decoder, tokens: list[int], positions: torch.Tensor, slot0: int,
                 tree_mask: torch.Tensor | None, taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """forward_logits() that also returns the taps: -> (logits (T, vocab), taps (T, len(taps) * D))."""
    if decoder is not None:
        hidden, tapped = decoder.hidden_taps(torch.tensor(tokens), positions, slot0, tree_mask, taps)
        return model.head(hidden), torch.cat(tapped, -1)
    with capture(model, taps) as out:
        hidden = model.hidden(torch.tensor([tokens]), slot0, positions=positions, tree_mask=tree_mask)[0]
    return model.head(hidden), torch.cat([o[0][0] for o in out], -1)


@torch.inference_mode()
def prefill_taps(model, prompt_ids: list[int], taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """prefill() that also returns the prompt's taps: -> (last logits (vocab,), taps (T, len(taps) * D))."""
    with capture(model, taps) as out:
        logits = prefill(model, prompt_ids)
    return logits, torch.cat([torch.cat([chunk[0] for chunk in o], 0) for o in out], -1)


@torch.inference_mode()
def sequence_taps(model, ids: list[int], taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole sequence teacher-forced (training data) -> (taps (T, len(taps) * D), the target's greedy prediction
    after each position (T,))."""
    x = torch.tensor([ids])
    with capture(model, taps) as out:
        hidden = model.hidden(x, 0)[0]
    preds = model.head(hidden).argmax(-1)
    return torch.cat([o[0][0] for o in out], -1), preds
