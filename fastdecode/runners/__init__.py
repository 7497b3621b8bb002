"""Runners: one forward pass over a batch of sequences' new rows with a paged KV cache -> final hidden states.

`Batch` is what every runner takes; `build_runner` picks the native C++ step where the model fits it and PyTorch's
modules otherwise (any torch device). The engine never asks which one it has.
"""
from __future__ import annotations

from fastdecode.layers.batch import Batch

__all__ = ["Batch", "build_runner"]


def build_runner(model, kv, native: bool = True, reduce=None):
    """The native runner when asked for and the kernels and the model allow it, else the PyTorch runner. `reduce`:
    a tensor-parallel shard's all-reduce, which the native step calls after each layer's attention and MLP (the
    PyTorch runner's modules carry their own, parallel/shard.py)."""
    from fastdecode.runners.native import NativeRunner
    from fastdecode.runners.pytorch import TorchRunner

    if native:
        runner = NativeRunner.build(model, kv, reduce)
        if runner is not None:
            return runner
    return TorchRunner(model, kv)
