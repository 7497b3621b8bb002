"""A runner over a small paged KV cache, and one forward over several sequences' new tokens: what the engine's
tests and the disk tier's run models with, below the engine."""
import random

import pytest
import torch

from fastdecode.engine.kv_cache import BlockTable, KVCache
from fastdecode.kernels import native_ops
from fastdecode.runners import Batch
from fastdecode.runners.native import NativeRunner
from fastdecode.runners.pytorch import TorchRunner

RUNNERS = {"native": NativeRunner.build, "pytorch": TorchRunner}


def paged(model, runner: str, blocks: int = 16, block_size: int = 8, dtype=torch.float32, positions: int = 256):
    """A runner over a small paged cache whose free blocks come in shuffled order (tables are not contiguous)."""
    model.setup_rope(positions)
    kv = KVCache.for_model(model.config, blocks * block_size, dtype, block_size=block_size)
    random.Random(0).shuffle(kv.free)
    r = RUNNERS[runner](model, kv)
    if r is None and native_ops() is None:
        pytest.skip("the native kernels are unavailable")
    assert r is not None, f"the {runner} runner declined {model.config.family}"
    return r, kv


def run(runner, kv, seqs: list[tuple[BlockTable, int, list[int]]], prompt_end: list[int] | None = None
        ) -> list[torch.Tensor]:
    """One forward over several sequences' new tokens (table, tokens already cached, new tokens) -> each one's
    logits (T, vocab). prompt_end: each sequence's prompt length (Batch.prompt_end), None: no row is a prompt's."""
    for table, start, new in seqs:
        kv.reserve(table, start + len(new))
    batch = kv.batch([(table, new, start) for table, start, new in seqs], prompt_end=prompt_end)
    rows = batch.seq_rows.tolist()
    with torch.inference_mode():
        logits = runner.model.head(runner.forward(batch))
    return [logits[a:b] for a, b in zip(rows, rows[1:])]


def tree_batch(kv, table: BlockTable, start: int, tokens: list[int], positions: torch.Tensor,
               tree_mask: torch.Tensor | None) -> Batch:
    """One sequence's verify step, as the engine builds it: `tokens` (a draft's root and nodes) at `positions`,
    written to the table's slots start.. after `start` cached tokens, seeing each other as `tree_mask` (T, T) says
    (None: a chain)."""
    kv.reserve(table, start + len(tokens))
    return Batch(torch.tensor(tokens), positions, torch.tensor(kv.slots(table, start, start + len(tokens))),
                 torch.tensor([0, len(tokens)]), torch.tensor([start]), torch.tensor([table.blocks]), kv.block_size,
                 tree_mask)
