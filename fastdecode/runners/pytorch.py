"""The PyTorch runner: the model's own modules over the paged cache, on any torch device (bfloat16 weights, a CPU
without the native kernels, a GPU later)."""
from __future__ import annotations

import torch

from fastdecode.runners.batch import Batch


class TorchRunner:
    name = "pytorch"

    def __init__(self, model, kv):
        self.model, self.kv = model, kv

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """-> final hidden states (R, D), before the final norm."""
        m = self.model
        x = m.embed(batch.tokens)
        for layer, block in enumerate(m.layers):
            rope = m.rope_local if block.self_attn.sliding else m.rope_global
            cos, sin = rope[0, batch.positions], rope[1, batch.positions]
            attn = block.self_attn.paged(block.input_layernorm(x), cos, sin, batch, self.kv.k[layer],
                                         self.kv.v[layer])
            x = block.after_attention(x, attn)
        return x
