"""What every runner takes: the rows of one forward pass over a paged cache (the reference forward's cache too, one
block per sequence), which the attention layer reads."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """The rows of one forward pass. Sequence b owns rows seq_rows[b]:seq_rows[b + 1], has context[b] tokens in the
    cache before them, and reads the cache through block_tables[b]; row r is token tokens[r] at position positions[r],
    its keys and values written to cache slot slots[r]. tree_mask (R, R) bool, when set, says which rows of its own
    sequence a row sees (a token tree being verified); None means every sequence's rows are a causal chain."""
    tokens: torch.Tensor  # (R,) int64
    positions: torch.Tensor  # (R,) int64
    slots: torch.Tensor  # (R,) int64
    seq_rows: torch.Tensor  # (B + 1,) int64
    context: torch.Tensor  # (B,) int64
    block_tables: torch.Tensor  # (B, W) int64, padded with 0
    block_size: int
    tree_mask: torch.Tensor | None = None
    # (B,) int64: sequence b's positions below prompt_end[b] are its prompt, whose attention the native runner may
    # compute with bf16 products (decode_step.cpp); None: every row is computed as a generated one.
    prompt_end: torch.Tensor | None = None
    # (N,) int64: the rows whose next-token logits the step needs (the LM head runs on them after the runner; a
    # tensor-parallel rank runs its slice of the head on them too); None: none.
    logit_rows: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.tokens.numel()
