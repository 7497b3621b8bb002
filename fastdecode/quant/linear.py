"""What the quantized linears share: the native/aten dispatch around a float32 (B*T, K) matmul, byte counts, and the
4-bit lookup kernel (lut4.cpp) that the FP4 formats and int4 with groups other than 32 decode with."""
import functools
from pathlib import Path

import torch
from torch import nn

from fastdecode.quant.kernels import native_ops


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) 4-bit values -> (N, K/2) uint8, element 2i in the low nibble (torch.float4_e2m1fn_x2's order; the
    checkpoint layout of int4 and FP4)."""
    return q[:, 0::2] | q[:, 1::2] << 4


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


class QuantLinear(nn.Module):
    """Subclasses set out_features, in_features, backend, bias, `native_op` (a name in the native module taking
    (x, qweight, bias)) and implement mm(x2d) -> (B*T, N) without the bias, for every other backend; rows(ids) ->
    (n, in_features) float32 for the backends in `row_backends`."""
    native_op: str
    row_backends: tuple[str, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "native":
            y = getattr(native_ops(), self.native_op)(x, self.qweight, self.bias)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        y = self.mm(x.reshape(-1, self.in_features).float())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def mm(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def split(self, parts: int) -> list["QuantLinear"]:
        """This module's rows as `parts` modules of equal height over views of its packed weight, no copy (an MoE
        layer's experts packed as one matrix). Native backend only: its qweight is tiles of 4 whole rows (dim 0)."""
        rows = self.out_features // parts
        if self.backend != "native" or rows * parts != self.out_features or rows % 4:
            raise ValueError(f"cannot split {self.out_features} {self.backend} rows into {parts} modules")
        tiles = self.qweight.view(parts, rows // 4, *self.qweight.shape[1:])
        out = []
        for i in range(parts):
            m = object.__new__(type(self))
            m.__dict__ = {**self.__dict__, "_buffers": dict(self._buffers), "_parameters": {}, "_modules": {},
                          "out_features": rows}
            m.qweight = tiles[i]
            m.bias = None if self.bias is None else self.bias[i * rows:(i + 1) * rows]
            out.append(m)
        return out

    def weight_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


@functools.cache
def lut_ops():
    """The compiled lut4.cpp (lut4_linear, max_rows), or None where native kernels are off or cannot be built."""
    from fastdecode.kernels.jit import build

    return build("fastdecode_lut4", [Path(__file__).with_name("lut4.cpp")], "dequantizing per forward")


def lut_fits(rows: int) -> bool:
    ops = lut_ops()
    return ops is not None and rows <= ops.max_rows
