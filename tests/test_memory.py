"""Tensors on fresh anonymous pages: zero, writable, and resident only where written."""
import resource

import pytest
import torch

from fastdecode import memory


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_a_large_buffer_is_zero_and_costs_memory_only_where_written():
    before = resident_bytes()
    t = memory.zeros(64, 1024, 1024, dtype=torch.float16)  # 128 MiB
    assert t.shape == (64, 1024, 1024) and t.dtype == torch.float16
    assert resident_bytes() - before < 16 << 20
    t[3].fill_(1.5)
    assert torch.all(t[3] == 1.5) and not t[2, -1].any() and not t[4, 0].any() and not t[-1, -1].any()
    assert resident_bytes() - before < 32 << 20


def test_small_buffers_come_from_torch():
    t = memory.zeros(4, 8, dtype=torch.float32)
    assert t.shape == (4, 8) and not t.any()


def anon_huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping holding t, from /proc/self/smaps."""
    addr, found = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "AnonHugePages:":
                return int(line.split()[1]) * 1024
    return 0


def test_weights_get_huge_pages_and_a_sparse_buffer_does_not():
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off on this machine")
    weights = memory.zeros(32, 1 << 20, dtype=torch.uint8)  # 32 MiB, written in full as packing does
    weights.fill_(1)
    sparse = memory.zeros(32, 1 << 20, dtype=torch.uint8, huge_pages=False)
    sparse.fill_(1)
    assert anon_huge_bytes(weights) >= 16 << 20  # shared anonymous memory (mmap's default) got none
    assert anon_huge_bytes(sparse) == 0


def test_weight_pages_come_from_the_allocator_in_force_else_fresh_pages():
    given = torch.zeros(2, 3, dtype=torch.uint8)
    with memory.weights_into(lambda shape, dtype: given if shape == (2, 3) else None):
        assert memory.weight_pages(2, 3, dtype=torch.uint8) is given
        declined = memory.weight_pages(4, 5, dtype=torch.uint8)  # the allocator declines: fresh zeros
    assert declined.shape == (4, 5) and not declined.any()
    assert memory.weight_pages(2, 3, dtype=torch.uint8) is not given
