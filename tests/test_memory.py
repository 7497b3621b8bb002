"""Tensors on fresh anonymous pages: zero, writable, and resident only where written."""
import resource

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
