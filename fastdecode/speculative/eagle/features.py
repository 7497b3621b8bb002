"""The target's reference forward over a whole sequence, with the residual streams after a few layers ("taps")
captured on the way: a feature-reading drafter's (EAGLE, MTP) training data. The engine's runners return the same taps
while serving (Runner.forward_taps)."""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def capture(model, taps: list[int]):
    """While open, every PyTorch forward of the model appends each tap layer's output (rows, D) to out[i]."""
    out: list[list[torch.Tensor]] = [[] for _ in taps]
    hooks = [model.layers[t].register_forward_hook(lambda m, i, o, k=k: out[k].append(o)) for k, t in enumerate(taps)]
    try:
        yield out
    finally:
        for h in hooks:
            h.remove()


@torch.inference_mode()
def sequence_taps(model, ids: list[int], taps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole sequence teacher-forced (training data) -> (taps (T, len(taps) * D), the target's greedy prediction
    after each position (T,))."""
    x = torch.tensor([ids])
    with capture(model, taps) as out:
        hidden = model.hidden(x, 0)[0]
    preds = model.head(hidden).argmax(-1)
    return torch.cat([o[0] for o in out], -1), preds  # (one sequence: its rows are its T tokens)
