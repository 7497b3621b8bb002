"""Weight-only int4, group-wise asymmetric (like llama.cpp's Q4_1): w ~ scale * q + min, q in 0..15, one fp16 scale
and min per group of group_size input channels.

Backends:
- "native" (kernels.cpp, groups of 32 only): activations quantized to int8 in blocks of 32, AVX2 integer dot
  products; the only one the whole-model native decode step takes.
- "lut" (lut4.cpp, any group size, the default where native does not fit): the nibbles and fp16 scales and mins as a
  checkpoint stores them; up to 16 input rows go through an AVX2 kernel that looks each weight up in a per-group
  16-entry table and multiplies with float activations; more rows (prefill) dequantize the weight and run a float
  GEMM: on a 512-token window that is ~50x faster here than torch's kernel (3072 x 576: 61 ms against 3.3 s).
- "aten" (torch's _weight_int4pack_mm_for_cpu, group size 32/64/128/256, float activations; it stores
  w = (q - 8) * scale + zero, so zero = min + 8 * scale): where the lookup kernel cannot be built.

A layer whose in_features is a multiple of 32 but not of a larger group (SmolLM2's 576 with groups of 128) gets a
shorter last group: the weight is padded to whole groups by repeating its last column (so the padding leaves that
group's min and max alone) and each input is padded with zeros, which cancel the padded columns.
"""
import torch
import torch.nn.functional as F

from fastdecode import memory
from fastdecode.quant.kernels import native_ops
from fastdecode.quant.linear import QuantLinear, lut_fits, lut_ops, pack_nibbles, unpack_nibbles
from fastdecode.quant.repack import move

EMPTY = torch.empty(0)
VALUES = torch.arange(16, dtype=torch.float32)  # the lookup kernel's table before scale and min: w = q * d + m


def padded_width(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


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


def to_blocks(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) in 0..15 -> (N, K/32, 16) uint8 in block order: byte j of a block = q[j] | q[j+16] << 4, the order of
    the native kernel and of a GGUF Q4_0/Q4_1 block."""
    N, K = q.shape
    blocks = q.reshape(N, K // 32, 2, 16)
    return blocks[:, :, 0] | blocks[:, :, 1] << 4


def from_blocks(qs: torch.Tensor) -> torch.Tensor:
    N = qs.shape[0]
    return torch.cat([qs & 15, qs >> 4], dim=-1).reshape(N, -1)


def pack_native(qs: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """qs (N, K/32, 16) in block order (to_blocks) -> (N/4, K/64, 160) uint8: per tile of 4 rows and pair of
    32-blocks, the 8 fp16 scales and the 8 fp16 mins in (row, block) order, then each row's 32 bytes (see
    kernels.cpp). Bytes move, no value is unpacked: a GGUF file's blocks go in as they are, read once from strided
    views of the file."""
    N, K = qs.shape[0], qs.shape[1] * 32
    out = memory.weight_pages(N // 4, K // 64, 160, dtype=torch.uint8)  # written once, from strided views of the inputs
    if (ops := native_ops()) is not None and qs.stride(2) == 1:
        ops.q4_pack(out, qs, scale.to(torch.float16), mn.to(torch.float16))  # the same bytes in one pass
        return out
    move(out[..., 32:].view(N // 4, K // 64, 4, 2, 16), qs.view(N // 4, 4, K // 64, 2, 16).transpose(1, 2))
    dm = out[..., :32].view(torch.float16).view(N // 4, K // 64, 2, 4, 2)  # (scale|min, row, block)
    for i, t in enumerate((scale, mn)):
        move(dm[:, :, i], t.to(torch.float16).reshape(N // 4, 4, K // 64, 2).transpose(1, 2))
    return out


def native_fits(out_features: int, in_features: int, group_size: int) -> bool:
    return native_ops() is not None and group_size == 32 and in_features % 64 == 0 and out_features % 4 == 0


def aten_fits(out_features: int, in_features: int, group_size: int) -> bool:
    return group_size in (32, 64, 128, 256) and in_features % 32 == 0 and out_features % 16 == 0


class Int4Linear(QuantLinear):
    native_op = "q4_linear"
    row_backends = ("native", "lut")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, backend: str, in_features: int | None = None):
        """q (N, Kp) uint8 in 0..15, or (N, Kp/32, 16) in block order (to_blocks; a GGUF block's, which the native
        layout takes without unpacking); scale and min (N, Kp / group_size); Kp is in_features padded to whole
        groups."""
        super().__init__()
        if q.dim() == 3 and backend != "native":
            q = from_blocks(q)
        self.out_features, padded = q.shape[0], q.shape[1] * (32 if q.dim() == 3 else 1)
        self.in_features = in_features or padded
        self.group_size, self.backend = group_size, backend
        if backend == "native":
            if not native_fits(self.out_features, padded, group_size) or padded != self.in_features:
                raise ValueError(f"native int4 needs groups of 32, in % 64 == 0, out % 4 == 0; got {tuple(q.shape)}")
            self.register_buffer("qweight", pack_native(q if q.dim() == 3 else to_blocks(q), scale, mn))
        elif backend == "lut":
            self.register_buffer("qweight", pack_nibbles(q))
            self.register_buffer("scales", scale.half())
            self.register_buffer("mins", mn.half())
        elif backend == "aten":
            packed, sz = pack_for_aten(q, scale.float(), mn.float())
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", sz)
        else:
            raise ValueError(f"unknown int4 backend {backend!r}")
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @staticmethod
    def fits(out_features: int, in_features: int, group_size: int) -> bool:
        return native_fits(out_features, in_features, group_size) or aten_fits(out_features, in_features, group_size)

    @staticmethod
    def resolve_backend(shape, group_size: int, backend: str | None) -> str:
        if backend:
            return backend
        return "native" if native_fits(*shape, group_size) else "lut" if lut_ops() is not None else "aten"

    @staticmethod
    def encode(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
        """Float weight (N, K) -> the tensors a checkpoint stores: qweight (N, Kp/2) nibbles, scales and mins
        (N, Kp/group_size) fp16."""
        K = w.shape[1]
        pad = padded_width(K, group_size) - K
        if pad:
            w = torch.cat([w, w[:, -1:].expand(-1, pad)], dim=1)
        q, scale, mn = quantize_groupwise(w, group_size)
        return {"qweight": pack_nibbles(q), "scales": scale.half(), "mins": mn.half()}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], bias: torch.Tensor | None = None, group_size: int = 32,
                     backend: str | None = None, in_features: int | None = None):
        """encode()'s tensors, or a GGUF Q4_0/Q4_1 tensor's: {"blocks" (N, K/32, 16) in block order, "scales",
        "mins"} (groups of 32)."""
        q = t["blocks"] if "blocks" in t else unpack_nibbles(t["qweight"])
        in_features = in_features or q.shape[1] * (32 if q.dim() == 3 else 1)
        backend = cls.resolve_backend((q.shape[0], in_features), group_size, backend)
        return cls(q, t["scales"], t["mins"], bias, group_size, backend, in_features)  # fp16 or float32

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32,
                    backend: str | None = None):
        return cls.from_tensors(cls.encode(w, group_size), bias, group_size, backend, w.shape[1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (n,) of the weight, dequantized: (n, in_features) float32, value for value what the stored
        blocks hold (q * d + m is exact in float32), for an embedding that shares this matrix (QuantEmbedding)."""
        if self.backend == "lut":
            q = unpack_nibbles(self.qweight[ids])
            w = dequantize_groupwise(q, self.scales[ids].float(), self.mins[ids].float())
            return w[:, :self.in_features]
        n, pick = len(ids), (torch.arange(len(ids)), ids % 4)
        tiles = self.qweight[ids // 4]  # (n, K/64, 160), see pack_native
        dm = tiles[..., :32].contiguous().view(torch.float16).view(n, -1, 2, 4, 2)  # (scale|min, row, block)
        dm = dm.permute(0, 3, 1, 2, 4)[pick].float()  # (n, K/64, scale|min, block)
        qs = tiles[..., 32:].reshape(n, -1, 4, 32).transpose(1, 2)[pick].reshape(n, -1, 16)  # (n, K/32, 16)
        q = from_blocks(qs).view(n, -1, 32).float()
        return (q * dm[:, :, 0].reshape(n, -1, 1) + dm[:, :, 1].reshape(n, -1, 1)).reshape(n, -1)

    def mm(self, x2d: torch.Tensor) -> torch.Tensor:
        groups = self.scales.shape[1] if self.backend == "lut" else self.scales_and_zeros.shape[0]
        padded = groups * self.group_size
        if padded > self.in_features:
            x2d = F.pad(x2d, (0, padded - self.in_features))
        if self.backend == "aten":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group_size,
                                                              self.scales_and_zeros)
        if lut_fits(x2d.shape[0]):
            return lut_ops().lut4_linear(x2d.contiguous(), self.qweight, self.group_size, VALUES, EMPTY, EMPTY,
                                         self.scales, self.mins, None)
        w = dequantize_groupwise(unpack_nibbles(self.qweight), self.scales.float(), self.mins.float())
        return x2d @ w.T

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}, backend={self.backend}")
