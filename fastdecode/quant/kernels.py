"""The quantized matmuls live in the native kernels module (fastdecode/kernels/quant.cpp), built on first use."""
from fastdecode.kernels import native_ops

__all__ = ["native_ops"]
