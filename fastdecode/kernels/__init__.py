"""Native CPU kernels (C++): quantized matmuls and the whole-model decode step, built on first use.

They are built for the widest instruction set the CPU runs, AVX2 or AVX-512 with VNNI (jit.kernel_isa), which takes
30-90 s once and is cached under $FASTDECODE_HOME/kernels (default ~/.cache/fastdecode; see jit.py). The two builds
agree to float rounding (the AVX-512 one sums in 16 lanes), and each gives the same result for a row whatever the
batch. Where the CPU lacks AVX2, the compiler fails, or FASTDECODE_NATIVE_KERNELS=0, `native_ops()` returns None and
every caller falls back to PyTorch's own kernels; FASTDECODE_REQUIRE_NATIVE=1 (CI) makes that a NativeBuildError
instead, so that tests of the native path fail rather than skip.
"""
import functools
from pathlib import Path

from fastdecode.kernels.jit import build, kernel_isa, native_enabled

__all__ = ["kernel_isa", "native_enabled", "native_ops"]

SOURCES = [Path(__file__).with_name(n)
           for n in ("quant.cpp", "amx.cpp", "kquant.cpp", "fp4.cpp", "decode_step.cpp", "copy.cpp", "peak.cpp",
                     "bindings.cpp")]


@functools.cache
def native_ops():
    """The compiled module (q8_linear, q4_linear, kq_linear, fp4_linear, forward_batch, copy_strided) for the widest
    instruction set this CPU runs (kernel_isa), or None where it cannot be had."""
    return native_ops_for(kernel_isa() if native_enabled() else "avx2")


@functools.cache
def native_ops_for(isa: str):
    """The module built for one instruction set (tests compare the builds)."""
    return build("fastdecode_native", SOURCES, "using PyTorch's kernels", isa)
