"""Byte moves for packing weights into the native tile layouts, fast enough that loading a GGUF costs about one read
of the file.

Packing is strided copies whose contiguous runs are short (a Q4_0 block's 16 bytes of nibbles, a 2-byte fp16 scale).
torch's copy_ moves those element by element and splits them across threads, which on a busy 2-core machine waits
for the slower core: on Qwen2.5-1.5B's Q4_0 gate_proj (7.7 MB) the nibble move took 3.6 ms on one thread and 5.6 ms
on two, against 0.74 ms in numpy, which copies each run as one opaque item (a void dtype of the run's size). numpy
still pays 5-10 ns a run (about 13 s of moves for an 8B Q4_0 model), so the native kernels' copy_strided (a fixed-size
memcpy per run, kernels/copy.cpp) does the moves where it is built; numpy is the fallback.
"""
import numpy as np
import torch

from fastdecode import memory
from fastdecode.kernels import native_ops


def move(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[...] = src for CPU tensors of one dtype and shape, any strides (src may be a view of a read-only mapped
    file); returns dst."""
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise ValueError(f"move: {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}")
    if dst.numel() == 0:
        return dst
    if (ops := native_ops()) is not None:
        return ops.copy_strided(dst, src)
    d, s = dst.numpy(), src.numpy()
    size = d.itemsize
    if d.ndim and d.strides[-1] == s.strides[-1] == size:  # the last axis is one run in both
        run = np.dtype((np.void, size * d.shape[-1]))
    else:
        run = np.dtype((np.void, size))
    d.view(run)[...] = s.view(run)
    return dst


class ShardArena:
    """One buffer that the joined shards of each packed module (q/k/v, gate/up) borrow in turn, before packing copies
    them into the module's own layout. Fresh pages are the dearest part of loading (the kernel zeroes each on first
    touch, about 1 GB/s in a VM against 17 GB/s to rewrite a page already made): joining into new memory each time made
    about 3 GB of them on an 8B model, this buffer only its largest module's."""

    def __init__(self):
        self.pages = torch.empty(0, dtype=torch.uint8)

    def join(self, parts: list[dict[str, torch.Tensor]], groups: int = 1) -> dict[str, torch.Tensor]:
        """{key: the parts' tensors of that key stacked along dim 0} (as torch.cat), held here until the next join.
        With groups > 1 each part is `groups` runs of rows, joined run by run (an MoE layer's experts: part p's rows
        of expert e follow the earlier parts' rows of expert e)."""
        if len(parts) == 1:
            return parts[0]
        sizes = {k: sum(p[k].numel() for p in parts) * t.element_size() for k, t in parts[0].items()}
        need = sum(-(-size // 64) * 64 for size in sizes.values())  # each tensor 64-byte aligned
        if self.pages.numel() < need:
            self.pages = memory.zeros(need, dtype=torch.uint8)
        out, at = {}, 0
        for k, size in sizes.items():
            first = parts[0][k]
            rows = sum(p[k].shape[0] for p in parts)
            out[k] = self.pages[at:at + size].view(first.dtype).view(rows, *first.shape[1:])
            joined, start = out[k].view(groups, rows // groups, *first.shape[1:]), 0
            for p in parts:
                n = p[k].shape[0] // groups
                move(joined[:, start:start + n], p[k].view(groups, n, *first.shape[1:]))
                start += n
            at += -(-size // 64) * 64
        return out

    def release(self, module: torch.nn.Module):
        """Gives `module` its own copy of any buffer that still views this arena (a backend that keeps an input as
        it is, e.g. fp16 scales), so the next join cannot overwrite it."""
        lo, hi = self.pages.data_ptr(), self.pages.data_ptr() + self.pages.numel()
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and b.numel() and lo <= b.data_ptr() < hi:
                    m._buffers[name] = b.clone()
