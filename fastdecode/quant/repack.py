"""Byte moves for packing weights into the native tile layouts, fast enough that loading a GGUF costs about one read
of the file.

Packing is strided copies whose contiguous runs are short (a Q4_0 block's 16 bytes of nibbles, a 2-byte fp16 scale).
torch's copy_ moves those element by element and splits them across threads, which on a busy 2-core machine waits
for the slower core: on Qwen2.5-1.5B's Q4_0 gate_proj (7.7 MB) the nibble move took 3.6 ms on one thread and 5.6 ms
on two, against 0.74 ms here, where numpy copies each run as one opaque item (a void dtype of the run's size).
"""
import numpy as np
import torch

from fastdecode import memory


def move(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst[...] = src for CPU tensors of one dtype and shape, any strides (src may be a view of a read-only mapped
    file); returns dst."""
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise ValueError(f"move: {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}")
    if dst.numel() == 0:
        return dst
    d, s = dst.numpy(), src.numpy()
    size = d.itemsize
    if d.ndim and d.strides[-1] == s.strides[-1] == size:  # the last axis is one run in both
        run = np.dtype((np.void, size * d.shape[-1]))
    else:
        run = np.dtype((np.void, size))
    d.view(run)[...] = s.view(run)
    return dst


def concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) along dim 0, moved with `move` (the shards of a packed module, strided views of a file)."""
    if len(parts) == 1:
        return parts[0]
    out = memory.zeros(sum(p.shape[0] for p in parts), *parts[0].shape[1:], dtype=parts[0].dtype)
    start = 0
    for p in parts:
        move(out[start:start + p.shape[0]], p)
        start += p.shape[0]
    return out
