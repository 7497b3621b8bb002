"""Spawned gloo ranks. Kept free of transformers: each spawned process imports this module, and transformers
takes seconds to import."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastdecode.agents.server import free_port  # (httpx, no transformers)
from fastdecode.parallel.group import init_group

WORLD = 2


def _run(rank: int, port: int, fn, args, out: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    init_group(WORLD, timeout_s=60)  # the rendezvous users get
    try:
        result = fn(rank, *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, *args):
    """fn(rank, *args) on WORLD spawned ranks of one gloo group -> what rank 0 returned. fn must be importable."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.pt")
        mp.spawn(_run, args=(free_port(), fn, args, out), nprocs=WORLD, join=True)
        return torch.load(out, weights_only=True)  # dicts, tuples, lists, tensors and numbers: no pickle needed
