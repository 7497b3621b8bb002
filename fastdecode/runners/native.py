"""The native runner: the whole forward in one call into C++ (decode_step.cpp), reading the paged cache through the
batch's block tables; the final norm and LM head stay in PyTorch (the engine applies them to the rows it samples)."""
from __future__ import annotations

import torch

from fastdecode.kernels import native_ops
from fastdecode.runners.base import Runner
from fastdecode.layers.batch import Batch
from fastdecode.runners.native_layers import EMPTY, SLOTS, layer_weights, model_shape, model_supported


class NativeRunner(Runner):
    name = "native"

    def __init__(self, model, ops, kv, reduce=None):
        """reduce(tensor): sums a layer's partial output across tensor-parallel ranks in place (None: one process)."""
        self.model, self.ops, self.kv, self.reduce = model, ops, kv, reduce
        self.shapes: dict[tuple[int, int], object] = {}  # (start, stop) -> the shape arguments of those layers
        self.weights = []
        for layer, block in enumerate(model.layers):
            self.weights += [*layer_weights(block), kv.k[layer], kv.v[layer]]

    @classmethod
    def build(cls, model, kv, reduce=None) -> "NativeRunner | None":
        if (not model_supported(model) or kv.k[0].dtype not in (torch.float32, torch.float16)
                or kv.k[0].device.type != "cpu"):
            return None
        ops = native_ops()
        return cls(model, ops, kv, reduce) if ops is not None else None

    def layers(self, x: torch.Tensor, batch: Batch, start: int, stop: int) -> torch.Tensor:
        """One call into C++ for the range."""
        m = self.model
        shape = self.shapes.get((start, stop))
        if shape is None:
            shape = self.shapes[start, stop] = model_shape(m, self.ops, slice(start, stop))
        return self.ops.forward_batch(
            x, self.weights[start * SLOTS:stop * SLOTS], batch.positions, batch.slots, batch.seq_rows, batch.context,
            EMPTY if batch.prompt_end is None else batch.prompt_end, batch.block_tables, batch.block_size,
            EMPTY if batch.tree_mask is None else batch.tree_mask, m.rope_global, m.rope_local, shape, self.reduce)
