"""The ranks' collectives over shared memory give gloo's results bit for bit, in rounds smaller than the tensors, and
fail with one RuntimeError (never a hang) when a peer falls silent or exits."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from fastdecode.parallel.collectives import Gloo, collectives
from tests.parallel.ranks import WORLD, run_ranks


def ops(comm, rank: int) -> dict:
    """Every collective the engine uses, on inputs that differ by rank; -> their results."""
    g = torch.Generator().manual_seed(rank)
    out = {}
    for name, t in {"float32": torch.randn(3, 5000, generator=g),  # 60 KB: many 4 KB rounds
                    "bfloat16": torch.randn(7, 333, generator=g).bfloat16(),
                    "columns": torch.randn(64, 48, generator=g).t()}.items():  # not contiguous
        t = t.clone()
        comm.all_reduce(t)
        out[f"sum {name}"] = t
    for n in (0, 3, 2000):
        t = torch.arange(n) + 100 if rank == 0 else torch.zeros(n, dtype=torch.long)
        comm.broadcast(t, 0)
        out[f"broadcast {n}"] = t
    out["gather"] = comm.all_gather(torch.randn(2, 1500, generator=g))
    return out


def compare_and_fail(rank: int, world: int) -> dict:
    shm = collectives(rank, world, 30, capacity=4096)
    result = {"transport": shm.name, "shm": ops(shm, rank), "gloo": ops(Gloo(), rank)}
    os.environ["FASTDECODE_TP_SHM"] = "0"
    result["switched off"] = collectives(rank, world, 30).name
    del os.environ["FASTDECODE_TP_SHM"]

    silent = collectives(rank, world, timeout_s=0.5)
    if rank == 0:
        result["silent"] = failure(silent)
    else:
        time.sleep(2.0)  # alive, but sends nothing
    dist.barrier()

    gone = collectives(rank, world, 60)
    if rank == 0:
        result["gone"] = failure(gone)
    return result  # rank 1 returns here, and its process exits


def failure(comm) -> tuple[str, float]:
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except RuntimeError as e:
        return str(e), time.monotonic() - t0
    return "", time.monotonic() - t0


@pytest.fixture(scope="module")
def ran():
    return run_ranks(compare_and_fail, WORLD)


def test_ranks_of_one_host_use_shared_memory_unless_switched_off(ran):
    assert ran["transport"] == "shared memory"
    assert ran["switched off"] == "gloo"


def test_shared_memory_gives_gloos_bits(ran):
    assert ran["shm"].keys() == ran["gloo"].keys()
    for key, expected in ran["gloo"].items():
        assert torch.equal(ran["shm"][key], expected), key
    assert ran["shm"]["broadcast 2000"].tolist() == list(range(100, 2100))
    assert ran["shm"]["gather"].shape == (WORLD, 2, 1500)


def test_a_silent_peer_fails_after_the_timeout(ran):
    message, waited = ran["silent"]
    assert "sent nothing for" in message
    assert 0.5 <= waited < 1.5


def test_a_peer_that_exited_fails_at_once(ran):
    message, waited = ran["gone"]
    assert "has exited" in message
    assert waited < 10  # against the group's 60 s timeout
