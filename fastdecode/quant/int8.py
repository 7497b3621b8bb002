"""Weight-only int8: w ~ d * q + m.

Backends differ in where the scale d lives:
- "native" (kernels/quant.cpp): per block of 32 input channels an fp16 scale d and an fp16 offset m, q in 0..255.
  Each block takes whichever of two encodings reproduces it better: asymmetric (m = the block's min, d = its range /
  255) or symmetric like llama.cpp's Q8_0 (d = amax / 127, m = -128 d). So a Q8_0 tensor (SmolLM2's tied head) is
  held exactly and a Q4_1 one (its other matrices) to within the fp16 rounding of d; symmetric alone re-rounds every
  Q4_1 value and cost 1.2 points of top-1 agreement on SmolLM2 (docs/quantization.md). Activations stay float,
  times the weights dequantized in registers (int8 activations cost another 1.5 points of top-1 agreement). A
  GGUF's Q8_0 (or Q5_0) tensor, loaded as it is, is computed as llama.cpp computes Q8_0 instead: activations
  quantized to int8 per block, exact integer block sums (pack_pairs), 2-4x faster over several rows.
- "aten" (torch's _weight_int8pack_mm, the fallback): symmetric, one float scale per output channel.

`encode` gives the backend-independent tensors a checkpoint stores: {"qweight", "scales", "mins"} per block (uint8
values, fp16 d and m), or {"qweight", "scales"} per channel (int8 values, float32 d). A Q8_0 GGUF tensor's
{"qweight" int8, "scales" per block} is read too (from_tensors).
"""
import logging

import torch

from fastdecode import memory
from fastdecode.quant.kernels import native_ops
from fastdecode.quant.linear import QuantLinear
from fastdecode.quant.repack import move

log = logging.getLogger(__name__)

QK = 32  # block length along K
PAIR_BYTES = 16 + 8 * QK  # a pair tile's bytes per pair of blocks


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> q (N, K) int8, scale (N,) float32."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_blockwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) float -> q (N, K) uint8, scale d and offset m (N, K/32) float32, fp16-exact; per block the better
    (least squared error) of the asymmetric and the symmetric encoding."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // QK, QK)
    fp16 = lambda t: t.half().float()  # noqa: E731
    m_asym = fp16(g.amin(-1))
    d_asym = fp16((g.amax(-1) - m_asym) / 255)
    d_sym = fp16(g.abs().amax(-1) / 127)
    encodings = []
    for d, m in ((d_asym, m_asym), (d_sym, -128 * d_sym)):
        q = torch.where(d[..., None] > 0, (g - m[..., None]) / d[..., None], 0).round().clamp(0, 255)
        err = (q * d[..., None] + m[..., None] - g).square().sum(-1)
        encodings.append((q, d, m, err))
    (qa, da, ma, ea), (qs, ds, ms, es) = encodings
    sym = es <= ea
    q = torch.where(sym[..., None], qs, qa).to(torch.uint8).reshape(N, K)
    return q, torch.where(sym, ds, da), torch.where(sym, ms, ma)


def dequantize_blockwise(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks (N, K) or (N, K/32, 32) back to float (N, K): uint8 q with offsets, or int8 q of Q8_0 without (mins
    None)."""
    N = q.shape[0]
    g = q.reshape(N, -1, QK).float() * scale.float()[..., None]
    if mins is not None:
        g = g + mins.float()[..., None]
    return g.reshape(N, -1)


def pack_native(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """q (N, K) or (N, K/32, 32) uint8 with offsets `mins`, or int8 with mins None (Q8_0: w = d q) -> the native
    layout, in the order quant.cpp reads it. A GGUF's Q8_0 (or Q5_0) tensor, int8 q without mins, with K a multiple of
    64 goes into pair tiles (N/4, K/64, 272), computed with int8 activations as llama.cpp computes it (pack_pairs);
    anything else (`--quant int8`: weight-only, its activations stay float) into tiles (N/4, K/32, 144): per tile of 4
    rows and block of 32, the 4 fp16 scales, the 4 fp16 offsets, then each row's 32 values. q, scale and mins may be
    strided views (of a GGUF file's blocks): each is read once."""
    N, K = q.shape[0], q[0].numel()
    if mins is None and K % 64 == 0:
        return pack_pairs(q, scale)
    if mins is None:  # w = d q = d (q + 128) - 128 d, exactly
        q, mins = (q.to(torch.int16) + 128).to(torch.uint8), -128 * scale.float()
    out = memory.weight_pages(N // 4, K // QK, 16 + 4 * QK, dtype=torch.uint8)  # written once, from strided views
    move(out[..., 16:].view(N // 4, K // QK, 4, QK), q.reshape(N // 4, 4, K // QK, QK).transpose(1, 2))
    for i, t in enumerate([scale, mins]):
        move(out[..., 8 * i:8 * i + 8].view(torch.float16),
             t.to(torch.float16).reshape(N // 4, 4, K // QK).transpose(1, 2))
    return out


def pack_pairs(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 q (N, K) or (N, K/32, 32), fp16-exact scale (N, K/32) -> (N/4, K/64, 272) uint8: per tile of 4 rows and
    pair of blocks (b, b+1), the 8 fp16 scales in (row, block) order, then each row's 64 values: elements 0..15 of b,
    of b+1, then 16..31 of b, of b+1 (the order the activations are quantized in)."""
    N, K = q.shape[0], q[0].numel()
    P = K // 64
    out = memory.weight_pages(N // 4, P, PAIR_BYTES, dtype=torch.uint8)
    blocks = q.view(N, 2 * P, 32)
    if (ops := native_ops()) is not None and blocks.stride(2) == 1:
        ops.q8_pack(out, blocks, scale.to(torch.float16))  # the same bytes in one pass
        return out
    move(out[..., 16:].view(torch.int8).view(N // 4, P, 4, 2, 2, 16),
         q.view(N // 4, 4, P, 2, 2, 16).permute(0, 2, 1, 4, 3, 5))
    move(out[..., :16].view(torch.float16).view(N // 4, P, 4, 2),
         scale.to(torch.float16).reshape(N // 4, 4, P, 2).transpose(1, 2))
    return out


def native_fits(out_features: int, in_features: int) -> bool:
    return native_ops() is not None and out_features % 4 == 0 and in_features % 32 == 0


class Int8Linear(QuantLinear):
    native_op = "q8_linear"
    row_backends = ("native",)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor | None, bias: torch.Tensor | None,
                 backend: str):
        """native: q (N, K) or (N, K/32, 32) uint8, scale and mins (N, K/32), or int8 q with mins None (Q8_0); aten:
        q (N, K) int8, scale (N,), mins None."""
        super().__init__()
        self.out_features, self.in_features = q.shape[0], q[0].numel()
        self.backend = backend
        if backend == "native":
            if not native_fits(self.out_features, self.in_features) or scale.dim() != 2 or (mins is None) != (q.dtype == torch.int8):
                raise ValueError(f"native int8 needs block scales, out % 4 == 0 and in % 32 == 0; got {tuple(q.shape)}")
            self.register_buffer("qweight", pack_native(q, scale, mins))
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
            q, scale, mins = quantize_blockwise(w)
            return {"qweight": q, "scales": scale.half(), "mins": mins.half()}
        q, scale = quantize_per_channel(w)
        return {"qweight": q, "scales": scale}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], bias: torch.Tensor | None = None, backend: str | None = None):
        """Builds the module from encode()'s tensors (or a Q8_0 GGUF tensor's). Block scales where the native kernel
        is missing are requantized per channel: the one case where a loaded checkpoint differs from the file."""
        q, scale, mins = t["qweight"], t["scales"], t.get("mins")  # fp16 block scales: packed as they are
        backend = cls.resolve_backend((q.shape[0], q[0].numel()), backend)
        if scale.dim() == 1:
            return cls(q, scale, None, bias, "aten")
        if backend != "native":
            log.warning("int8 block scales need the native kernel; requantizing %s per channel", tuple(q.shape))
            return cls(*quantize_per_channel(dequantize_blockwise(q, scale, mins)), None, bias, "aten")
        return cls(q, scale, mins, bias, backend)

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None):
        backend = cls.resolve_backend(w.shape, backend)
        return cls.from_tensors(cls.encode(w, backend), bias, backend)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (n,) of the native weight, dequantized: (n, in_features) float32, value for value what the
        stored blocks hold, for an embedding that shares this matrix (QuantEmbedding)."""
        n, pick = len(ids), (torch.arange(len(ids)), ids % 4)
        tiles = self.qweight[ids // 4]  # (n, K/64, 272) | (n, K/32, 144), see pack_native
        if tiles.shape[-1] == PAIR_BYTES:  # Q8_0: w = d q
            d = tiles[..., :16].contiguous().view(torch.float16).view(n, -1, 4, 2).transpose(1, 2)[pick].float()
            # (n, K/64, block of the pair, half of the block, 16)
            q = tiles[..., 16:].reshape(n, -1, 4, 2, 2, 16).permute(0, 2, 1, 4, 3, 5)[pick]
            return (q.reshape(n, -1, QK).view(torch.int8).float() * d.reshape(n, -1, 1)).reshape(n, -1)
        dm = tiles[..., :16].contiguous().view(torch.float16).view(n, -1, 2, 4)  # (scale|min, row)
        dm = dm.permute(0, 3, 1, 2)[pick].float()  # (n, K/32, scale|min)
        q = tiles[..., 16:].reshape(n, -1, 4, QK).transpose(1, 2)[pick]  # (n, K/32, 32)
        return (q.float() * dm[..., :1] + dm[..., 1:]).reshape(n, -1)

    def mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2d, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, backend={self.backend}"
