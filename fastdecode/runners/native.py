"""The native runner: the whole forward in one call into C++ (decode_step.cpp), reading the paged cache through the
batch's block tables; the final norm and LM head stay in PyTorch (the engine applies them to the rows it samples)."""
from __future__ import annotations

import torch

from fastdecode.kernels import native_ops
from fastdecode.runners.native_layers import EMPTY, layer_weights, model_shape, model_supported
from fastdecode.runners.batch import Batch


class NativeRunner:
    name = "native"

    def __init__(self, model, ops, kv, reduce=None):
        """reduce(tensor): sums a layer's partial output across tensor-parallel ranks in place (None: one process)."""
        self.model, self.ops, self.kv, self.reduce = model, ops, kv, reduce
        self.shape = model_shape(model, ops)
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

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """-> final hidden states (R, D), before the final norm."""
        m = self.model
        return self.ops.forward_batch(
            m.embed(batch.tokens), self.weights, batch.positions, batch.slots, batch.seq_rows, batch.context,
            EMPTY if batch.prompt_end is None else batch.prompt_end, batch.block_tables, batch.block_size,
            EMPTY if batch.tree_mask is None else batch.tree_mask, m.rope_global, m.rope_local, self.shape,
            self.reduce)
