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
    tokens, positions, slots, rows, context = [], [], [], [0], []
    for table, start, new in seqs:
        kv.reserve(table, start + len(new))
        tokens += new
        positions += range(start, start + len(new))
        slots += kv.slots(table, start, start + len(new))
        rows.append(len(tokens))
        context.append(start)
    width = max(len(t.blocks) for t, _, _ in seqs)
    tables = torch.tensor([t.blocks + [0] * (width - len(t.blocks)) for t, _, _ in seqs])
    batch = Batch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots), torch.tensor(rows),
                  torch.tensor(context), tables, kv.block_size,
                  prompt_end=None if prompt_end is None else torch.tensor(prompt_end))
    with torch.inference_mode():
        logits = runner.model.head(runner.forward(batch))
    return [logits[a:b] for a, b in zip(rows, rows[1:])]
