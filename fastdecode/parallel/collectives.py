"""The ranks' collectives, one interface over two transports: all_reduce(t) sums in place, broadcast(t, src) copies
rank src's t into everyone's, all_gather(t) -> every rank's t stacked (world, *t.shape).

Where every rank runs on this host (torchrun --nproc-per-node N, the common case), they go through a shared memory
segment (kernels/shm_group.cpp): a decode step's all-reduce takes microseconds there, against 0.7-1.4 ms over
gloo's loopback TCP, and a step makes two a layer. Across hosts, or with FASTDECODE_TP_SHM=0, or where the module
cannot be built, gloo. The ranks agree on one transport (`collectives` is itself a collective call).
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

CAPACITY = 4 << 20  # bytes a rank sends per round: a 512-row float32 prefill chunk of a 2k-wide model is one round
PATH_BYTES = 256


class Gloo:
    name = "gloo"

    def __init__(self, pg: dist.ProcessGroup | None = None):
        self.pg = pg  # None: the default group

    def all_reduce(self, t: torch.Tensor):
        dist.all_reduce(t, group=self.pg)

    def broadcast(self, t: torch.Tensor, src: int):
        dist.broadcast(t, src, group=self.pg)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.pg))]
        dist.all_gather(parts, t.contiguous(), group=self.pg)
        return torch.stack(parts)


class SharedMemory:
    name = "shared memory"

    def __init__(self, group):
        self.group = group  # shm_group.SharedMemoryGroup: owns the mapping
        self.all_reduce, self.broadcast, self.all_gather = group.all_reduce, group.broadcast, group.all_gather


def shm_module():
    from fastdecode.kernels.jit import build

    return build("fastdecode_shm_group", [Path(__file__).parents[1] / "kernels" / "shm_group.cpp"],
                 "tensor-parallel ranks talk over gloo")


def collectives(rank: int, world: int, timeout_s: float, pg: dist.ProcessGroup | None = None,
                capacity: int = CAPACITY) -> Gloo | SharedMemory:
    """Every rank of the group calls this at the same point. Shared memory where all ranks share this host and each
    maps the segment rank 0 made, else gloo."""
    if world == 1:
        return Gloo(pg)
    module = shm_module() if os.environ.get("FASTDECODE_TP_SHM", "1") != "0" else None
    # The same host: the same name and boot. Keys are compared by their min and max across the ranks.
    host = zlib.crc32(f"{socket.gethostname()} {boot_id()}".encode())
    state = torch.tensor([host, -host, module is not None])
    dist.all_reduce(state, dist.ReduceOp.MIN, group=pg)
    if not (int(state[0]) == -int(state[1]) and state[2]):
        return Gloo(pg)
    path = torch.zeros(PATH_BYTES, dtype=torch.uint8)
    if rank == 0:
        made = make_segment(module.SharedMemoryGroup.size(world, capacity))
        if made:
            path[:len(made)] = torch.tensor(list(made.encode()), dtype=torch.uint8)
    dist.broadcast(path, 0, group=pg)
    name = bytes(path.tolist()).rstrip(b"\0").decode()
    group = None
    if name:
        try:
            group = module.SharedMemoryGroup(name, rank, world, capacity, timeout_s)
        except RuntimeError as e:  # another container's /dev/shm, say
            log.info("fastdecode: rank %d cannot map %s (%s): tensor-parallel ranks talk over gloo", rank, name, e)
    mapped = torch.tensor([group is not None])
    dist.all_reduce(mapped, dist.ReduceOp.MIN, group=pg)  # every rank has mapped it (or given up) past this point
    if rank == 0 and name:
        os.unlink(name)  # the mappings keep it alive; nothing is left behind when the ranks exit
    return SharedMemory(group) if mapped.item() else Gloo(pg)


def make_segment(size: int) -> str | None:
    """A new file of `size` bytes in /dev/shm (the temp folder where there is none), readable by this user only, its
    pages reserved now (a full tmpfs fails here rather than with SIGBUS on first touch). -> its path, or None."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"fastdecode-tp-{os.getpid()}-{secrets.token_hex(8)}")
    if len(path.encode()) >= PATH_BYTES:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        return path
    except OSError as e:
        log.info("fastdecode: no room for %d bytes in %s (%s): tensor-parallel ranks talk over gloo", size, folder, e)
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
