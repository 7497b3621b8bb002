"""Weight-only int8, symmetric: w ~ d * q with q in -127..127.

Backends differ in where the scale d lives:
- "native" (kernels.cpp): one fp16 scale per block of 32 input channels, like llama.cpp's Q8_0 (it reproduces a Q8_0
  GGUF tensor exactly and halves the error of per-channel scales on SmolLM2); activations are quantized to int8
  in blocks of 32 and multiplied with AVX2 integer dot products.
- "aten" (torch's _weight_int8pack_mm, the fallback): one float scale per output channel, float activations.
"""
import torch
from torch import nn

from fastdecode.quant.kernels import native_ops
from fastdecode.quant.linear import QuantLinear


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> q (N, K) int8, scale (N,) float32."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> q (N, K) int8, scale (N, K/32) float32, fp16-exact (0 for an all-zero block)."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // 32, 32)
    scale = (g.abs().amax(-1) / 127).half().float()
    q = torch.where(scale[..., None] > 0, g / scale[..., None], 0).round().clamp(-127, 127).to(torch.int8)
    return q.reshape(N, K), scale


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    return (q.reshape(N, K // 32, 32).float() * scale[..., None]).reshape(N, K)


def pack_native(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """-> (N/4, K/32, 136) uint8: per tile of 4 rows and block of 32, the 4 fp16 scales, then each row's 32 values,
    in the order kernels.cpp reads them."""
    N, K = q.shape
    d = scale.half().reshape(N // 4, 4, K // 32).transpose(1, 2).contiguous().view(torch.uint8)  # (N/4, K/32, 8)
    values = q.reshape(N // 4, 4, K // 32, 32).transpose(1, 2).reshape(N // 4, K // 32, 128).view(torch.uint8)
    return torch.cat([d, values], dim=-1).contiguous()


def native_fits(out_features: int, in_features: int) -> bool:
    return native_ops() is not None and out_features % 4 == 0 and in_features % 32 == 0


class Int8Linear(QuantLinear):
    native_op = "q8_linear"

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None, backend: str):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.backend = backend
        if backend == "native":
            if not native_fits(*w.shape):
                raise ValueError(f"native int8 needs out % 4 == 0 and in % 32 == 0; got {tuple(w.shape)}")
            self.register_buffer("qweight", pack_native(*quantize_blockwise(w)))
        else:
            q, scale = quantize_per_channel(w)
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None):
        return cls(w, bias, backend or ("native" if native_fits(*w.shape) else "aten"))

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str | None = None):
        return cls.from_weight(linear.weight, linear.bias, backend)

    def aten_mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, backend={self.backend}"
