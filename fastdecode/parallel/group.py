"""The process group, from the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fastdecode.errors import InvalidRequestError
from fastdecode.parallel.collectives import Gloo, SharedMemory, collectives

# Every collective, a follower's wait for rank 0's next command included, fails after this long: a rank that hangs
# cannot hang the others. Rank 0 pings its followers when idle, so only silence this long means trouble.
DEFAULT_TIMEOUT_S = float(os.environ.get("FASTDECODE_TP_TIMEOUT", 120))


@dataclass
class Group:
    rank: int
    world: int
    timeout_s: float
    comm: Gloo | SharedMemory  # the steps' collectives: shared memory where every rank is on this host
    pg: dist.ProcessGroup | None = None  # None: the default group; set-up's own collectives (gloo)

    @property
    def leads(self) -> bool:
        return self.rank == 0


def init_group(tp: int, timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "cpu") -> Group:
    """Joins (or reuses) the default process group (gloo for CPU tensors, NCCL for CUDA ones), and sets up the
    collectives the steps use."""
    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world != tp or "MASTER_ADDR" not in os.environ:
            raise InvalidRequestError(f"--tp {tp} runs one process per rank: launch it as `torchrun --nproc-per-node "
                                      f"{tp} -m fastdecode ...` (this process sees WORLD_SIZE={world})")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's agent already runs the store
            dist.init_process_group(backend, timeout=timeout)
        else:
            rank = int(os.environ.get("RANK", 0))
            dist.init_process_group(backend, store=rendezvous_store(rank, world, timeout), rank=rank, world_size=world,
                                    timeout=timeout)
    if dist.get_world_size() != tp:
        raise InvalidRequestError(f"--tp {tp} does not match the process group of {dist.get_world_size()} ranks")
    rank, world = dist.get_rank(), dist.get_world_size()
    return Group(rank, world, timeout_s, collectives(rank, world, timeout_s))


def rendezvous_store(rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The store the ranks meet at, MASTER_ADDR:MASTER_PORT. Rank 0 listens on that address only: torch's own store
    listens on every interface, unauthenticated, so with MASTER_ADDR=127.0.0.1 anyone on the network could still
    reach it and join or disrupt the group."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout=timeout)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen()
    # detach(): the store owns the descriptor from here; the socket object must not close it when collected.
    return dist.TCPStore(host, port, world, True, timeout=timeout, master_listen_fd=listener.detach())
