"""Native CPU kernels (C++, AVX2): quantized matmuls and the whole-model decode step, built on first use.

The build takes 30-90 s once and is cached under $FASTDECODE_HOME/kernels (default ~/.cache/fastdecode; see
jit.py). Where the CPU lacks AVX2, the compiler fails, or FASTDECODE_NATIVE_KERNELS=0, `native_ops()` returns None
and every caller falls back to PyTorch's own kernels, so results never depend on the build; FASTDECODE_REQUIRE_NATIVE=1
(CI) makes that a NativeBuildError instead, so that tests of the native path fail rather than skip.
"""
import functools
from pathlib import Path

from fastdecode.kernels.jit import FLAGS, build, native_enabled

__all__ = ["FLAGS", "native_enabled", "native_ops"]

SOURCES = [Path(__file__).with_name(n) for n in ("quant.cpp", "kquant.cpp", "decode_step.cpp", "bindings.cpp")]


@functools.cache
def native_ops():
    """The compiled module (q8_linear, q4_linear, kq_linear, forward_batch), or None where it cannot be had."""
    return build("fastdecode_native", SOURCES, "using PyTorch's kernels")
