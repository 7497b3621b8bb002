"""Weight-only int4, group-wise asymmetric (like llama.cpp's Q4_1): w ~ scale * q + min, q in 0..15, one fp16 scale
and min per group of group_size input channels.

Backends: "native" (kernels.cpp, groups of 32 only: activations quantized to int8 in blocks of 32, AVX2 integer
dot products) and "aten" (torch's _weight_int4pack_mm_for_cpu, group size 32/64/128/256, float activations; it
stores w = (q - 8) * scale + zero, so zero = min + 8 * scale).
"""
import torch
from torch import nn

from fastdecode.quant.kernels import native_ops
from fastdecode.quant.linear import QuantLinear


def quantize_groupwise(w: torch.Tensor, group_size: int = 32):
    """w (N, K) float -> q (N, K) uint8 in 0..15, scale and min (N, K / group_size) float32 (fp16-exact)."""
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"in_features {K} is not a multiple of the group size {group_size}")
    g = w.detach().float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    # Rounded to fp16 before q is computed, so q is optimal for the scale and min the kernel will see.
    scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
    mn = lo.half().float()
    q = ((g - mn[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), scale, mn


def dequantize_groupwise(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    g = q.reshape(N, scale.shape[1], -1).float()
    return (g * scale[..., None] + mn[..., None]).reshape(N, K)


def pack_for_aten(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor):
    """-> (packed weight for _weight_int4pack_mm_for_cpu, scales_and_zeros (K / group_size, N, 2))."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales_and_zeros = torch.stack([scale, mn + 8 * scale], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros


def pack_native(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """-> (N/4, K/64, 160) uint8: per tile of 4 rows and pair of 32-blocks, the 8 fp16 scales and the 8 fp16 mins
    in (row, block) order, then each row's 32 bytes, byte j of a block = q[j] | q[j+16] << 4 (see kernels.cpp)."""
    N, K = q.shape
    blocks = q.reshape(N, K // 32, 2, 16)
    qs = (blocks[:, :, 0] | blocks[:, :, 1] << 4).reshape(N // 4, 4, K // 64, 32).transpose(1, 2)

    def tiles(t):  # (N, K/32) -> (N/4, K/64, 4 rows, 2 blocks)
        return t.half().reshape(N // 4, 4, K // 64, 2).transpose(1, 2)
    dm = torch.stack([tiles(scale), tiles(mn)], dim=2).reshape(N // 4, K // 64, 16).view(torch.uint8)
    return torch.cat([dm, qs.reshape(N // 4, K // 64, 128)], dim=-1).contiguous()


def native_fits(out_features: int, in_features: int, group_size: int) -> bool:
    return native_ops() is not None and group_size == 32 and in_features % 64 == 0 and out_features % 4 == 0


def aten_fits(out_features: int, in_features: int, group_size: int) -> bool:
    return group_size in (32, 64, 128, 256) and in_features % group_size == 0 and out_features % 16 == 0


class Int4Linear(QuantLinear):
    native_op = "q4_linear"

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, group_size: int, backend: str):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.group_size, self.backend = group_size, backend
        q, scale, mn = quantize_groupwise(w, group_size)
        if backend == "native":
            if not native_fits(*w.shape, group_size):
                raise ValueError(f"native int4 needs groups of 32, in % 64 == 0, out % 4 == 0; got {tuple(w.shape)}")
            self.register_buffer("qweight", pack_native(q, scale, mn))
        else:
            packed, sz = pack_for_aten(q, scale, mn)
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @staticmethod
    def fits(out_features: int, in_features: int, group_size: int) -> bool:
        return native_fits(out_features, in_features, group_size) or aten_fits(out_features, in_features, group_size)

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32,
                    backend: str | None = None):
        backend = backend or ("native" if native_fits(*w.shape, group_size) else "aten")
        return cls(w, bias, group_size, backend)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32, backend: str | None = None):
        return cls.from_weight(linear.weight, linear.bias, group_size, backend)

    def aten_mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group_size, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, backend={self.backend}")
