"""Weight-only FP4: E2M1 values under a shared block scale, in the two published layouts.

- MXFP4 (OCP Microscaling Formats spec v1.0): blocks of 32 values, one E8M0 scale each (a power of two, the byte is
  the biased exponent, 127 = 2^0, 255 = NaN). The spec's scale rule: X = 2^(floor(log2(amax)) - 2), 2 being E2M1's
  largest exponent, and values are rounded to nearest-even and clamped to +-6 (so a block's largest values, which land
  in [4, 8) * X, clip at 6 * X: the format's own loss).
- NVFP4 (NVIDIA, Blackwell): blocks of 16 values, one FP8 E4M3 scale each, and one float32 scale per tensor chosen so
  the largest block scale lands on E4M3's maximum 448: w ~ e2m1 * e4m3_block_scale * tensor_scale, with
  tensor_scale = amax(w) / (6 * 448).

E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit; magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Two codes a byte
(linear.pack_nibbles).

Fp4Linear keeps the codes and scales (4.25 / 4.5 bits a weight). Backends:
- "native" (MXFP4, K % 64 == 0, N % 4 == 0: gpt-oss's experts): kernels/fp4.cpp, llama.cpp's arithmetic. The
  activations are quantized to int8 per block of 32 and the doubled E2M1 values (integers in -12..12) meet them in
  exact integer dot products; the blocks are repacked once into tiles of 4 rows read in one stream, 4.25 bits a
  weight still. The only FP4 backend the whole-model native step takes.
- "lut": for a few rows of input (decode) an AVX2 kernel (lut4.cpp, built on first use) looks the weights up 8 at a
  time from a per-block table and multiplies them with the float activations, never materialising W; for more rows
  (prefill) the whole weight is dequantized at that forward and a float matmul runs.
- "dequant": dequantize + float matmul always (no kernel, or asked for).
No CPU has FP4 arithmetic: FP4 saves memory and bandwidth, not arithmetic.
"""
import torch
import torch.nn.functional as F

from fastdecode import memory
from fastdecode.quant import int4
from fastdecode.quant.kernels import native_ops
from fastdecode.quant.linear import QuantLinear, lut_fits, lut_ops, pack_nibbles, unpack_nibbles
from fastdecode.quant.repack import move

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
E2M1_MAX, E2M1_EMAX, E4M3_MAX = 6.0, 2, 448.0
# All 16 codes -> value; and each byte -> its two values, so dequantizing is one gather.
E2M1_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES])
BYTE_TABLE = torch.stack([E2M1_TABLE.repeat(16), E2M1_TABLE.repeat_interleave(16)], dim=-1)  # (256, 2)
BLOCK_SIZE = {"mxfp4": 32, "nvfp4": 16}  # values sharing one scale
EMPTY = torch.empty(0)
TILE_BYTES = 8 + 4 * 32  # the native layout: per 4 rows and pair of blocks, 8 scale bytes and 4 x 32 code bytes


# ---- E2M1 -------------------------------------------------------------------------------------------------------
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit codes (uint8), round to nearest, ties to even (even mantissa), saturating at +-6."""
    a = x.abs().float().clamp(max=E2M1_MAX)
    i = torch.bucketize(a, E2M1_MIDPOINTS)  # number of midpoints below a: ties go to the lower code ...
    tie = (a == E2M1_MIDPOINTS[i.clamp(max=6)]) & (i % 2 == 1)
    i = i + tie.to(i.dtype)  # ... unless the lower code's mantissa bit is set (odd index): then the upper one
    sign = ((x < 0) & (i > 0)).to(torch.uint8) << 3
    return i.to(torch.uint8) | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_TABLE[codes.long()]


# ---- MXFP4 ------------------------------------------------------------------------------------------------------
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> codes (N, K) uint8, scales (N, K/32) uint8 E8M0 (biased exponents)."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // 32, 32)
    amax = g.abs().amax(-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent with m in [0.5, 1): floor(log2(amax)) = exponent - 1
    shared = torch.where(amax > 0, exponent - 1 - E2M1_EMAX, -127).clamp(-127, 127)
    codes = e2m1_encode(torch.ldexp(g, -shared[..., None].float()))
    return codes.reshape(N, K), (shared + 127).to(torch.uint8)


def e8m0_decode(scales: torch.Tensor) -> torch.Tensor:
    s = torch.exp2(scales.float() - 127)
    return torch.where(scales == 255, torch.nan, s)


# ---- NVFP4 ------------------------------------------------------------------------------------------------------
def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) -> codes (N, K) uint8, scales (N, K/16) uint8 (E4M3 bits), tensor_scale () float32."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // 16, 16)
    amax = g.abs().amax()
    tensor_scale = amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else torch.tensor(1.0)
    block = (g.abs().amax(-1) / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    step = block.float() * tensor_scale  # what one E2M1 unit is worth in this block, as the decoder sees it
    codes = e2m1_encode(torch.where(step[..., None] > 0, g / step[..., None], 0))
    return codes.reshape(N, K), block.view(torch.uint8), tensor_scale.float()


def e4m3_decode(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.float8_e4m3fn).float()


# ---- both -------------------------------------------------------------------------------------------------------
def block_scales(fmt: str, scales: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """Stored scales -> float multiplier per block (N, K/block)."""
    return e8m0_decode(scales) if fmt == "mxfp4" else e4m3_decode(scales) * tensor_scale


def quantize_fp4(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """Float weight -> {"qweight" (N, K/2) uint8, "scales" (N, K/block) uint8, "tensor_scale" () float32}."""
    if fmt == "mxfp4":
        codes, scales = quantize_mxfp4(w)
        tensor_scale = torch.tensor(1.0)
    else:
        codes, scales, tensor_scale = quantize_nvfp4(w)
    return {"qweight": pack_nibbles(codes), "scales": scales, "tensor_scale": tensor_scale}


def dequantize_fp4(t: dict[str, torch.Tensor], fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    packed, scales = t["qweight"], t["scales"]
    N, blocks = scales.shape
    values = BYTE_TABLE.to(dtype).index_select(0, packed.flatten().int())  # (N * K/2, 2)
    w = values.view(N, blocks, -1) * block_scales(fmt, scales, t["tensor_scale"]).to(dtype)[..., None]
    return w.view(N, -1)


# ---- the native layout (kernels/fp4.cpp) --------------------------------------------------------------------------
def to_blocks(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/2) codes, element 2i in the low nibble -> (N, K/32, 16) in GGUF's block order: byte j of a block holds
    element j in its low nibble and element j + 16 in its high one (as a Q4_0 block's)."""
    return int4.to_blocks(unpack_nibbles(qweight))


def from_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """to_blocks' inverse."""
    return pack_nibbles(int4.from_blocks(blocks))


def native_fits(fmt: str, out_features: int, in_features: int) -> bool:
    return fmt == "mxfp4" and native_ops() is not None and in_features % 64 == 0 and out_features % 4 == 0


def pack_native(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks (N, K/32, 16) in GGUF's order, scales (N, K/32) E8M0 bytes -> (N/4, K/64, 136) uint8 tiles: per 4 rows
    and pair of blocks, the 8 scale bytes in (row, block) order, then each row's 32 code bytes (fp4.cpp). Bytes move,
    no value changes; the inputs may be strided views of a mapped file, read once."""
    N, K = blocks.shape[0], blocks.shape[1] * 32
    out = memory.weight_pages(N // 4, K // 64, TILE_BYTES, dtype=torch.uint8)
    if (ops := native_ops()) is not None and blocks.stride(2) == 1:
        ops.fp4_pack(out, blocks, scales)
        return out
    move(out[..., :8].view(N // 4, K // 64, 4, 2), scales.reshape(N // 4, 4, K // 64, 2).transpose(1, 2))
    move(out[..., 8:].view(N // 4, K // 64, 4, 32), blocks.reshape(N // 4, 4, K // 64, 32).transpose(1, 2))
    return out


def unpack_native(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_native's tiles -> (blocks (N, K/32, 16), scales (N, K/32))."""
    T, P, _ = tiles.shape
    scales = tiles[..., :8].reshape(T, P, 4, 2).transpose(1, 2).reshape(4 * T, 2 * P)
    blocks = tiles[..., 8:].reshape(T, P, 4, 32).transpose(1, 2).reshape(4 * T, 2 * P, 16)
    return blocks, scales


def scale_table(fmt: str, tensor_scale: torch.Tensor) -> torch.Tensor:
    """(256,) float32: every scale byte -> the block's multiplier, for the kernel's per-block lookup."""
    return block_scales(fmt, torch.arange(256, dtype=torch.uint8)[None], tensor_scale)[0].contiguous()


class Fp4Linear(QuantLinear):
    """MXFP4 or NVFP4 weights, on the backends above."""
    native_op = "fp4_linear"

    def __init__(self, fmt: str, t: dict[str, torch.Tensor], bias: torch.Tensor | None, backend: str | None = None):
        """t: {"qweight" (N, K/2) codes, element 2i in the low nibble, or "blocks" (N, K/32, 16) in GGUF's order (a
        file's MXFP4 blocks, views of it), "scales" (N, K/block), optionally "tensor_scale"}."""
        super().__init__()
        self.fmt = fmt
        blocks, scales = t.get("blocks"), t["scales"]
        self.out_features = scales.shape[0]
        self.in_features = blocks.shape[1] * 32 if blocks is not None else t["qweight"].shape[1] * 2
        if scales.shape[1] * BLOCK_SIZE[fmt] != self.in_features:
            raise ValueError(f"{fmt}: in_features {self.in_features} does not match scales {tuple(scales.shape)}")
        self.backend = backend or ("native" if native_fits(fmt, self.out_features, self.in_features) else
                                   "lut" if lut_ops() is not None else "dequant")
        if self.backend == "native":
            if not native_fits(fmt, self.out_features, self.in_features):
                raise ValueError(f"native fp4 needs mxfp4, in % 64 == 0, out % 4 == 0; got {fmt} "
                                 f"{self.out_features} x {self.in_features}")
            self.register_buffer("qweight", pack_native(to_blocks(t["qweight"]) if blocks is None else blocks, scales))
        else:
            self.register_buffer("qweight", (from_blocks(blocks) if blocks is not None else t["qweight"])
                                 .to(torch.uint8).contiguous())
            self.register_buffer("scales", scales.to(torch.uint8).contiguous())
        # MXFP4 has no tensor scale: files holding its blocks (GGUF, gpt-oss safetensors) give none.
        self.register_buffer("tensor_scale", t.get("tensor_scale", torch.tensor(1.0)).float().reshape(()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.table = scale_table(fmt, self.tensor_scale)  # not a buffer: derived, and not part of the weight bytes

    @classmethod
    def from_weight(cls, w: torch.Tensor, fmt: str, bias: torch.Tensor | None = None, backend: str | None = None):
        return cls(fmt, quantize_fp4(w, fmt), bias, backend)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight (N, K/2) codes, element 2i in the low nibble, scales (N, K/block)), whatever the backend."""
        if self.backend == "native":
            blocks, scales = unpack_native(self.qweight)
            return from_blocks(blocks), scales
        return self.qweight, self.scales

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        qweight, scales = self.codes()
        return dequantize_fp4({"qweight": qweight, "scales": scales, "tensor_scale": self.tensor_scale}, self.fmt,
                              dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "native":
            return super().forward(x)
        x2d = x.reshape(-1, self.in_features)
        if self.backend == "lut" and lut_fits(x2d.shape[0]):
            y = lut_ops().lut4_linear(x2d.float().contiguous(), self.qweight, BLOCK_SIZE[self.fmt], E2M1_TABLE,
                                      self.scales, self.table, EMPTY, EMPTY, self.bias)
            return y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.dequantize(dtype), bias).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.fmt}, in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
                f"backend={self.backend}")
