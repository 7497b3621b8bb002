"""The PyTorch runner: the model's own modules over the paged cache, on any torch device (bfloat16 weights, a CPU
without the native kernels, a GPU later)."""
from __future__ import annotations

import torch

from fastdecode.runners.base import Runner
from fastdecode.layers.batch import Batch


class TorchRunner(Runner):
    name = "pytorch"

    def __init__(self, model, kv):
        self.model, self.kv = model, kv

    def layers(self, x: torch.Tensor, batch: Batch, start: int, stop: int) -> torch.Tensor:
        return self.model.run_layers(x, batch, self.kv.k, self.kv.v, start, stop)
