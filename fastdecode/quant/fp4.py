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

Fp4Linear keeps the codes and scales (4.25 / 4.5 bits a weight). For a few rows of input (decode) an AVX2 kernel
(lut4.cpp, built on first use) looks the weights up 8 at a time from a per-block table and multiplies them with the
float activations, never materialising W; for more rows (prefill), or without the kernel, the whole weight is
dequantized at that forward and a float matmul runs. Neither is a packed low-precision dot product (no CPU has
FP4 arithmetic): FP4 saves memory and bandwidth, not arithmetic.
"""
import torch
from torch import nn
import torch.nn.functional as F

from fastdecode.quant.linear import QuantLinear, lut_fits, lut_ops, pack_nibbles

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDPOINTS = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
E2M1_MAX, E2M1_EMAX, E4M3_MAX = 6.0, 2, 448.0
# All 16 codes -> value; and each byte -> its two values, so dequantizing is one gather.
E2M1_TABLE = torch.cat([E2M1_VALUES, -E2M1_VALUES])
BYTE_TABLE = torch.stack([E2M1_TABLE.repeat(16), E2M1_TABLE.repeat_interleave(16)], dim=-1)  # (256, 2)
BLOCK_SIZE = {"mxfp4": 32, "nvfp4": 16}  # values sharing one scale
EMPTY = torch.empty(0)


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


def scale_table(fmt: str, tensor_scale: torch.Tensor) -> torch.Tensor:
    """(256,) float32: every scale byte -> the block's multiplier, for the kernel's per-block lookup."""
    return block_scales(fmt, torch.arange(256, dtype=torch.uint8)[None], tensor_scale)[0].contiguous()


class Fp4Linear(QuantLinear):
    """MXFP4 or NVFP4 weights. backend "lut": the AVX2 kernel for up to its max_rows input rows, dequantize + float
    matmul beyond; "dequant": dequantize + float matmul always (no kernel, or asked for)."""

    def __init__(self, fmt: str, t: dict[str, torch.Tensor], bias: torch.Tensor | None, backend: str | None = None):
        super().__init__()
        self.fmt = fmt
        self.out_features, self.in_features = t["qweight"].shape[0], t["qweight"].shape[1] * 2
        if t["scales"].shape[1] * BLOCK_SIZE[fmt] != self.in_features:
            raise ValueError(f"{fmt}: in_features {self.in_features} does not match scales {tuple(t['scales'].shape)}")
        self.register_buffer("qweight", t["qweight"].to(torch.uint8).contiguous())
        self.register_buffer("scales", t["scales"].to(torch.uint8).contiguous())
        # MXFP4 has no tensor scale: files holding its blocks (GGUF, gpt-oss safetensors) give none.
        self.register_buffer("tensor_scale", t.get("tensor_scale", torch.tensor(1.0)).float().reshape(()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.backend = backend or ("lut" if lut_ops() is not None else "dequant")
        self.table = scale_table(fmt, self.tensor_scale)  # not a buffer: derived, and not part of the weight bytes

    @staticmethod
    def encode(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
        return quantize_fp4(w, fmt)

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], fmt: str, bias: torch.Tensor | None = None,
                     backend: str | None = None):
        return cls(fmt, t, bias, backend)

    @classmethod
    def from_weight(cls, w: torch.Tensor, fmt: str, bias: torch.Tensor | None = None, backend: str | None = None):
        return cls(fmt, quantize_fp4(w, fmt), bias, backend)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, backend: str | None = None):
        return cls.from_weight(linear.weight, fmt, linear.bias, backend)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp4({"qweight": self.qweight, "scales": self.scales, "tensor_scale": self.tensor_scale},
                              self.fmt, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
