"""A packed projection whose output rows are held in more than one format.

A Q4_K_M (or Q5_K_M) file stores q and k in Q4_K but v in Q6_K in about half its layers; one module holds one tile
layout, so the packed q/k/v is kept as parts, each in its file's own blocks on its own kernel, and the output is
theirs side by side. The native decode step runs a q/k/v of two parts (decode_step.cpp's QKV2 slots).
"""
import torch
from torch import nn


class RowSplitLinear(nn.Module):
    def __init__(self, parts: list[nn.Module]):
        """parts: linears over the same inputs, each computing the next rows of the output (biases their own)."""
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("RowSplitLinear: every part must take the same inputs")
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
