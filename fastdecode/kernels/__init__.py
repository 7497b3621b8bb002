"""Native CPU kernels (C++, AVX2): quantized matmuls and the whole-model decode step, built on first use.

The build takes 30-90 s once and is cached under $FASTDECODE_HOME/kernels (default ~/.cache/fastdecode). Where the
CPU lacks AVX2, the compiler fails, or FASTDECODE_NATIVE_KERNELS=0, `native_ops()` returns None and every caller
falls back to PyTorch's own kernels, so results never depend on the build.
"""
import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(n) for n in ("quant.cpp", "decode_step.cpp", "bindings.cpp")]
# Plain AVX2 flags, not -march=native: a cached build must also run on another CPU of the machine pool.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


def native_enabled() -> bool:
    return (os.environ.get("FASTDECODE_NATIVE_KERNELS", "1") != "0"
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


@functools.cache
def native_ops():
    """The compiled module (q8_linear, q4_linear, forward_batch), or None where it cannot be had."""
    if not native_enabled():
        return None
    try:
        from torch.utils.cpp_extension import load

        from fastdecode.loading.catalog import fastdecode_home

        build_dir = fastdecode_home() / "kernels"
        build_dir.mkdir(parents=True, exist_ok=True)
        return load("fastdecode_native", [str(s) for s in SOURCES], extra_cflags=FLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir))
    except Exception as e:  # no compiler, no ninja, a compile error: PyTorch's kernels still work
        log.warning("fastdecode: native kernels unavailable, using PyTorch's (%s)", str(e).splitlines()[0])
        return None
