"""One OpenMP team per process, so the engine's thread keeps its worker threads spinning between parallel regions.

PyTorch's CPU build runs its parallel loops (and our kernels' `at::parallel_for`) on GNU OpenMP. Every thread that
starts a parallel region gets a pool of worker threads of its own, kept for the thread's life. Once a process has
more such threads than CPUs (the thread that loaded the model keeps its pool of 2 on a 2-core machine, and the engine's
thread adds another), libgomp throttles every worker's spin-wait to about 100 iterations: a worker then sleeps on a
futex after each region and is woken for the next, and the decode step, a few hundred small regions, ran at half
speed (measured: 43 against 85 tok/s on SmolLM2-135M int4, 2 threads; a 576x576 matrix-vector product, 108 against
16 us). `release_openmp_workers()` ends the calling thread's pool (OpenMP 5.0's omp_pause_resource_all); a thread
that runs a parallel region later gets a fresh one.
"""
from __future__ import annotations

import ctypes
import functools
import os
from contextlib import contextmanager
from pathlib import Path

import torch

OMP_PAUSE_SOFT = 1


@functools.cache
def _pause():
    """omp_pause_resource_all from the OpenMP runtime torch loaded, or None (another runtime, or too old)."""
    for name in (str(Path(torch.__file__).parent / "lib" / "libgomp.so.1"), "libgomp.so.1", "libiomp5.so"):
        try:
            fn = ctypes.CDLL(name, mode=os.RTLD_NOLOAD).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def release_openmp_workers() -> bool:
    """Ends the calling thread's OpenMP worker threads (cheap when it has none) -> whether the runtime allowed it."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


@contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op thread count set to `threads` (None: left as it is) inside the block, restored after; yields
    the count in force."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
