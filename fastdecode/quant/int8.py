"""Weight-only int8, symmetric: w ~ d * q with q in -127..127.

Backends differ in where the scale d lives:
- "native" (kernels/quant.cpp): one fp16 scale per block of 32 input channels, like llama.cpp's Q8_0 (it reproduces a
  Q8_0 GGUF tensor exactly and halves the error of per-channel scales on SmolLM2); float activations times the
  weights dequantized in registers (quantizing activations to int8 as well cost 2% top-1 agreement).
- "aten" (torch's _weight_int8pack_mm, the fallback): one float scale per output channel, float activations.

`encode` gives the backend-independent tensors a checkpoint stores ({"qweight", "scales"}); the scales' shape says
which granularity they are: (N, K/32) fp16 per block or (N,) float32 per channel.
"""
import logging

import torch
from torch import nn

from fastdecode.quant.kernels import native_ops
from fastdecode.quant.linear import QuantLinear

log = logging.getLogger(__name__)


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

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, backend: str):
        """q (N, K) int8; scale (N, K/32) per block (native) or (N,) per output channel (aten)."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.backend = backend
        if backend == "native":
            if not native_fits(*q.shape) or scale.dim() != 2:
                raise ValueError(f"native int8 needs block scales, out % 4 == 0 and in % 32 == 0; got {tuple(q.shape)}")
            self.register_buffer("qweight", pack_native(q, scale))
        else:
            if scale.dim() != 1:
                raise ValueError("aten int8 takes one scale per output channel")
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @staticmethod
    def resolve_backend(shape, backend: str | None) -> str:
        return backend or ("native" if native_fits(*shape) else "aten")

    @staticmethod
    def encode(w: torch.Tensor, backend: str) -> dict[str, torch.Tensor]:
        """Float weight -> the tensors a checkpoint stores for this backend."""
        if backend == "native":
            q, scale = quantize_blockwise(w)
            return {"qweight": q, "scales": scale.half()}
        q, scale = quantize_per_channel(w)
        return {"qweight": q, "scales": scale}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], bias: torch.Tensor | None = None, backend: str | None = None):
        """Builds the module from encode()'s tensors (or a Q8_0 GGUF tensor's). Block scales where the native kernel
        is missing are requantized per channel: the one case where a loaded checkpoint differs from the file."""
        q, scale = t["qweight"], t["scales"].float()
        backend = cls.resolve_backend(q.shape, backend)
        if scale.dim() == 2 and backend != "native":
            log.warning("int8 block scales need the native kernel; requantizing %s per channel", tuple(q.shape))
            q, scale = quantize_per_channel(dequantize_blockwise(q, scale))
        elif scale.dim() == 1:
            backend = "aten"
        return cls(q, scale, bias, backend)

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None):
        backend = cls.resolve_backend(w.shape, backend)
        return cls.from_tensors(cls.encode(w, backend), bias, backend)

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str | None = None):
        return cls.from_weight(linear.weight, linear.bias, backend)

    def mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, backend={self.backend}"
