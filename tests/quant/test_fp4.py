"""MXFP4 and NVFP4: encodings against hand-made vectors worked out from the published definitions (OCP Microscaling
Formats v1.0 for E2M1 and E8M0; NVIDIA's NVFP4 for the E4M3 block scale and the float32 tensor scale), error bounds
from the E2M1 grid, and Fp4Linear against the float matmul."""
import copy

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from fastdecode.quant import Fp4Linear, fp4, quantize_linear, quantize_model, weight_bytes
from fastdecode.quant.fp4 import (dequantize_fp4, e2m1_decode, e2m1_encode, e4m3_decode, e8m0_decode, quantize_fp4,
                                  quantize_mxfp4, quantize_nvfp4)
from fastdecode.quant.linear import pack_nibbles as pack_codes, unpack_nibbles as unpack_codes
from tests.helpers.tiny import logits, tiny_model
from tests.quant.test_kquant import half_step_bound

NATIVE = pytest.mark.skipif(not fp4.native_fits("mxfp4", 4, 64), reason="no native kernels")

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_codes_are_sign_two_exponent_bits_one_mantissa_bit():
    assert e2m1_decode(torch.arange(16)).tolist() == E2M1 + [-v for v in E2M1]
    assert e2m1_encode(torch.tensor(E2M1)).tolist() == list(range(8))
    assert e2m1_encode(torch.tensor([-v for v in E2M1[1:]])).tolist() == list(range(9, 16))


def test_e2m1_rounds_to_nearest_with_ties_to_even_mantissa_and_saturates():
    # Each midpoint goes to the neighbour whose mantissa bit is 0: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    # 3.5->4, 5->4. Beyond 6 saturates (the MX spec clamps, no infinity in E2M1).
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 4.9, 7.0, 100.0, -5.0, -0.2])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [0, 1, 1, 2, 2, 4, 4, 0.5, 4, 6, 6, -4, 0]


def test_pack_puts_element_2i_in_the_low_nibble():
    codes = torch.tensor([[0x7, 0x5, 0xB, 0x1]], dtype=torch.uint8)
    assert pack_codes(codes).tolist() == [[0x57, 0x1B]]
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


def test_mxfp4_hand_vector():
    w = torch.zeros(1, 128)
    # Block 0: amax 6 -> shared exponent floor(log2 6) - 2 = 0, E8M0 byte 127; the values sit on the grid or at ties.
    w[0, :16] = torch.tensor([6, 3, -1.5, 0.5, 0.25, 0.75, -0.75, 5, 2.5, 1.25, 1.75, 3.5, 0, -6, 4, 1])
    # Block 1: amax 100 -> floor(log2 100) - 2 = 4, X = 16, byte 131; 100/16 = 6.25 clamps to 6 (96), 40/16 = 2.5
    # ties to 2 (32), -7/16 = -0.4375 rounds to -0.5 (-8), 0.9/16 rounds to 0.
    w[0, 32:36] = torch.tensor([100, 40, -7, 0.9])
    # Block 2 is all zeros: the smallest scale, byte 0. Block 3: amax 2^-130 wants exponent -132, clamped to -127.
    w[0, 96] = 2.0**-130
    codes, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[127, 131, 0, 0]]
    packed = pack_codes(codes)[0]
    assert packed[:8].tolist() == [0x57, 0x1B, 0x20, 0x6A, 0x24, 0x64, 0xF0, 0x26]
    assert packed[16:18].tolist() == [0x47, 0x09] and not packed[18:].any()
    w_hat = dequantize_fp4(quantize_fp4(w, "mxfp4"), "mxfp4")[0]
    assert w_hat[:16].tolist() == [6, 3, -1.5, 0.5, 0, 1, -1, 4, 2, 1, 2, 4, 0, -6, 4, 1]
    assert w_hat[32:36].tolist() == [96, 32, -8, 0]


def test_e8m0_is_a_biased_power_of_two_with_255_nan():
    assert e8m0_decode(torch.tensor([127, 131, 0, 254], dtype=torch.uint8)).tolist() == [1, 16, 2.0**-127, 2.0**127]
    assert e8m0_decode(torch.tensor([255], dtype=torch.uint8)).isnan().all()


def test_e4m3_block_scale_bits():
    # 1.0 = 0 0111 000, 448 (the maximum, 1.75 * 2^8) = 0 1111 110, 2^-9 (smallest subnormal) = 0 0000 001,
    # 0.1015625 = 1.625 * 2^-4 = 0 0011 101.
    bits = torch.tensor([0x38, 0x7E, 0x01, 0x1D], dtype=torch.uint8)
    assert e4m3_decode(bits).tolist() == [1.0, 448.0, 2.0**-9, 0.1015625]


def test_nvfp4_hand_vector():
    w = torch.zeros(1, 32)
    # Tensor amax 2688 = 6 * 448: the tensor scale is 1. Block 0 (amax 2688) gets the largest E4M3 scale, 448.
    w[0, :4] = torch.tensor([2688, 1344, -448, 224])
    # Block 1: amax 0.6 -> 0.6 / 6 = 0.1, rounded to E4M3 0.1015625 (byte 0x1D); 0.6 / 0.1015625 = 5.91 -> 6,
    # 0.3 -> 2.95 -> 3, -0.1 -> -0.98 -> -1.
    w[0, 16:19] = torch.tensor([0.6, 0.3, -0.1])
    codes, scales, tensor_scale = quantize_nvfp4(w)
    assert tensor_scale.item() == 1.0
    assert scales.tolist() == [[0x7E, 0x1D]]
    packed = pack_codes(codes)[0]
    assert packed[:2].tolist() == [0x57, 0x1A] and packed[8:10].tolist() == [0x57, 0x0A]
    w_hat = dequantize_fp4(quantize_fp4(w, "nvfp4"), "nvfp4")[0]
    assert w_hat[:4].tolist() == [2688, 1344, -448, 224]
    assert w_hat[16:19].tolist() == [6 * 0.1015625, 3 * 0.1015625, -0.1015625]


def test_nvfp4_tensor_scale_maps_the_largest_block_to_448():
    w = torch.randn(8, 64) * 0.02
    _, scales, tensor_scale = quantize_nvfp4(w)
    assert tensor_scale.item() == pytest.approx(w.abs().max().item() / (6 * 448))
    assert e4m3_decode(scales).max().item() == 448.0


def half_gap(v: torch.Tensor) -> torch.Tensor:
    """Half the distance between E2M1 neighbours around |v| (in units of the block scale)."""
    a = v.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


def test_mxfp4_error_is_half_a_grid_step_or_the_clip_above_6():
    w = torch.randn(64, 256)
    t = quantize_fp4(w, "mxfp4")
    scale = e8m0_decode(t["scales"]).repeat_interleave(32, dim=1)
    v = w / scale
    bound = torch.where(v.abs() > 6, v.abs() - 6, half_gap(v)) * scale
    assert ((dequantize_fp4(t, "mxfp4") - w).abs() <= bound * (1 + 1e-6)).all()


def test_nvfp4_error_is_half_a_grid_step_of_its_block():
    w = torch.randn(64, 256) * 0.05
    t = quantize_fp4(w, "nvfp4")
    step = (e4m3_decode(t["scales"]) * t["tensor_scale"]).repeat_interleave(16, dim=1)
    v = w / step
    # E4M3's rounding of the block scale (3 mantissa bits) can put the block's max at up to 6 * 17/16 = 6.375 steps:
    # clipped by at most 0.375, within the top half-gap of 1.
    assert v.abs().max() <= 6.375
    bound = half_gap(v) * step
    assert ((dequantize_fp4(t, "nvfp4") - w).abs() <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_linear_equals_float_matmul_with_dequantized_weight(fmt, m):
    torch.manual_seed(m)
    w, b = torch.randn(96, 128) * 0.05, torch.randn(96)
    layer = Fp4Linear.from_weight(w, fmt, b, backend="lut")  # float activations (native: see below)
    x = torch.randn(m, 128)
    ref = F.linear(x, dequantize_fp4(quantize_fp4(w, fmt), fmt), b)
    assert torch.allclose(layer(x), ref, rtol=1e-5, atol=1e-5)


def mxfp4_weight(N: int, K: int, seed: int) -> dict[str, torch.Tensor]:
    """Random codes under scales spread over 2^-10..2^-3, every code and many scales present."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
    return {"qweight": pack_codes(codes), "scales": torch.randint(117, 125, (N, K // 32), dtype=torch.uint8,
                                                                  generator=g)}


def kernel_reference(x: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """fp4.cpp's arithmetic in float64: x rounded to int8 per block of 32 (d = amax / 127, half to even), the exact
    integer sum of each block's doubled E2M1 values times the int8 activations, times 2^(e - 128) d."""
    M, K = x.shape
    xb = x.double().reshape(M, -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xb / torch.where(d > 0, d, 1))  # torch.round: half to even
    v = (2 * e2m1_decode(unpack_codes(t["qweight"]))).double().reshape(t["qweight"].shape[0], -1, 32)
    sums = torch.einsum("mbk,nbk->mnb", q, v)  # exact: integers under 2^53
    scale = torch.exp2(t["scales"].double() - 128)  # (N, K/32)
    return (sums * scale[None] * d[:, None, :, 0]).sum(-1)


@NATIVE
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 17, 40])  # 17, 40: the tiled kernel (AMX, else VNNI)
def test_native_kernel_is_the_integer_arithmetic_of_llama_cpp(m):
    # Every code and the scales through the lookup, the offset and the per-block scaling: float64 arithmetic on the
    # same int8 activations agrees to float32 rounding of the sums.
    t = mxfp4_weight(64, 2880, seed=m)
    x = torch.randn(m, 2880, generator=torch.Generator().manual_seed(100 + m))
    y = Fp4Linear("mxfp4", t, None, backend="native")(x)
    ref = kernel_reference(x, t)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@NATIVE
@pytest.mark.parametrize("m", [1, 3, 17])
def test_native_output_within_activation_rounding_of_dequantized_matmul(m):
    t, bias = mxfp4_weight(40, 768, seed=m), torch.randn(40)
    layer = Fp4Linear("mxfp4", t, bias, backend="native")
    w = dequantize_fp4({**t, "tensor_scale": torch.tensor(1.0)}, "mxfp4")
    x = torch.randn(m, 768)
    err = (layer(x).double() - (x.double() @ w.double().T + bias.double())).abs()
    assert (err <= half_step_bound(x, w).double()).all()
    assert err.max() < 0.2 * half_step_bound(x, w).max()


@NATIVE
def test_native_row_does_not_depend_on_how_many_rows_share_the_call():
    """Up to 4 rows a pass, and from 16 rows the tiled kernel (AMX, else VNNI over the tiles' layout) takes blocks of
    32 weight rows (here 32 of the 44): a verify step, a prompt chunk and a batch must reproduce decode steps bit for
    bit."""
    layer = Fp4Linear("mxfp4", mxfp4_weight(44, 320, seed=0), torch.randn(44), backend="native")
    x = torch.randn(40, 320)
    for m in (1, 2, 3, 4, 5, 9, 15, 16, 17, 33, 40):
        y = layer(x[:m])
        assert all(torch.equal(y[i], layer(x[i:i + 1])[0]) for i in range(m)), m


@NATIVE
def test_native_tiles_hold_the_codes_and_scales_as_they_are(monkeypatch):
    t = mxfp4_weight(16, 192, seed=1)
    native = Fp4Linear("mxfp4", t, None, backend="native")
    assert native.weight_bytes() == 16 * 192 // 2 + 16 * 192 // 32 + 4  # 4.25 bits a weight, and the tensor scale
    assert torch.equal(native.dequantize(), Fp4Linear("mxfp4", t, None, backend="dequant").dequantize())
    # fp4_pack on strided views (a file's blocks: a scale byte, then 16 code bytes) writes the bytes of the moves
    raw = torch.cat([t["scales"][..., None], fp4.to_blocks(t["qweight"])], dim=-1)  # (N, K/32, 17)
    packed = fp4.pack_native(raw[..., 1:], raw[..., 0])
    assert torch.equal(packed, native.qweight)
    monkeypatch.setattr(fp4, "native_ops", lambda: None)
    assert torch.equal(fp4.pack_native(raw[..., 1:], raw[..., 0]), packed)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_batched_and_bfloat16_inputs(fmt):
    layer = Fp4Linear.from_weight(torch.randn(32, 64), fmt)  # mxfp4: native, bf16 rounds the int8 activations too
    x = torch.randn(2, 5, 64)
    y = layer(x)
    assert y.shape == (2, 5, 32) and torch.allclose(y[1, 3], layer(x[1, 3:4])[0], atol=1e-5)
    yb = layer(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and torch.allclose(yb.float(), y, rtol=0.05, atol=0.3)


@pytest.mark.parametrize("fmt,scale_bytes", [("mxfp4", 32 * 64 // 32), ("nvfp4", 32 * 64 // 16)])
def test_weight_bytes_are_four_bits_plus_one_byte_per_block(fmt, scale_bytes):
    layer = quantize_linear(nn.Linear(64, 32, bias=True), fmt)
    assert layer.weight_bytes() == 32 * 64 // 2 + scale_bytes + 4 + 32 * 4  # codes, block scales, tensor scale, bias


@pytest.mark.parametrize("fmt,agreement,error", [("mxfp4", 0.7, 0.2), ("nvfp4", 0.8, 0.15)])
def test_quantized_model_agrees_with_float_model(fmt, agreement, error):
    model = tiny_model(tied=False)
    tokens = torch.randint(0, 128, (4, 32))
    ref = logits(model, tokens)
    quantized = quantize_model(copy.deepcopy(model), fmt, lm_head_scheme=fmt)
    assert all(isinstance(m, Fp4Linear) for m in quantized.modules() if hasattr(m, "in_features"))
    out = logits(quantized, tokens)
    # E2M1's grid is coarse at the top of its range and MXFP4's power-of-two scales clip a block's largest values:
    # on this random model (close top-2 logits) 15% (MXFP4) and 11% (NVFP4) of the logits' norm, int4 g32's 6.5%.
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= agreement
    assert (out - ref).norm() / ref.norm() < error
    assert weight_bytes(quantized) < weight_bytes(model) / 6


def test_shapes_off_the_block_stay_float():
    model = nn.Sequential(nn.Linear(48, 16))  # 48 is three NVFP4 blocks but not a whole MXFP4 block
    quantize_model(model, "mxfp4", lm_head_scheme="mxfp4")
    assert type(model[0]) is nn.Linear
    quantize_model(model, "nvfp4", lm_head_scheme="nvfp4")
    assert isinstance(model[0], Fp4Linear)
