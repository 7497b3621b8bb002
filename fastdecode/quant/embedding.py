"""A token embedding that reads its rows out of a quantized matrix instead of holding a float table.

A GGUF file's embedding is blocks (Q8_0, Q4_0, Q6_K, ...) like its other matrices; held as float32 it would be the
largest thing in memory (Llama-3.1-8B: 2.1 GB against 0.3 GB of Q4_0). Where lm_head is tied to it, the two share
one module; the rows come back as exactly the float values the blocks dequantize to.
"""
import torch
from torch import nn

from fastdecode.quant.linear import QuantLinear


class QuantEmbedding(nn.Module):
    def __init__(self, table: QuantLinear, dtype: torch.dtype = torch.float32):
        super().__init__()
        if table.backend not in table.row_backends:
            raise ValueError(f"{type(table).__name__} ({table.backend}) cannot look up rows")
        self.table = table
        # An empty (0, D) tensor, not the table: code that asks the embedding's dtype and device (the KV cache's
        # setup, the native decoder's check) learns what the lookups return, as from a float table in `dtype`.
        self.register_buffer("weight", torch.empty(0, table.in_features, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) -> (..., D) in the table's dtype."""
        rows = self.table.rows(ids.reshape(-1)).view(*ids.shape, self.table.in_features)
        return rows.to(self.weight.dtype)
