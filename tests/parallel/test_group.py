"""The rendezvous: rank 0's store listens on MASTER_ADDR only, and ranks still meet through it."""
import errno
import socket

import pytest
import torch
import torch.distributed as dist

from fastdecode.parallel.group import init_group
from tests.parallel.ranks import WORLD, free_port, run_ranks


def test_the_store_listens_on_master_addr_only(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    init_group(1)
    try:
        # Another address of this host, same port: free unless the store listens on every interface.
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.2", port))
            except OSError as e:
                pytest.fail(f"the store listens beyond 127.0.0.1 ({errno.errorcode.get(e.errno, e.errno)})")
    finally:
        dist.destroy_process_group()


def all_reduced(rank: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_ranks_meet_through_the_bound_store():
    assert run_ranks(all_reduced) == sum(range(1, WORLD + 1))
