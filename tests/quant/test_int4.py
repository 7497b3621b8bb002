"""Int4Linear against the float matmul, within bounds derived from the quantization steps, and quantize_model("int4")
on a tiny random Transformer against the float model."""
import copy

import pytest
import torch
from torch import nn

from fastdecode.quant import Int4Linear, Int8Linear, quantize_linear, quantize_model, weight_bytes
from fastdecode.quant import int4
from fastdecode.quant.int4 import dequantize_groupwise, native_fits, quantize_groupwise
from fastdecode.quant.linear import lut_ops
from tests.helpers.tiny import logits, tiny_model

NATIVE = pytest.param("native", marks=pytest.mark.skipif(not native_fits(4, 64, 32), reason="no AVX2 kernels"))
NO_LUT = pytest.mark.skipif(lut_ops() is None, reason="no AVX2 lookup kernel")
LUT = pytest.param("lut", marks=NO_LUT)
CASES = [("aten", 32), ("aten", 64), ("aten", 128), pytest.param("native", 32, marks=NATIVE.marks),
         pytest.param("lut", 32, marks=NO_LUT), pytest.param("lut", 128, marks=NO_LUT)]


def step_bound(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per weight, the worst |w - w_hat|: half a step, plus the fp16 rounding of the group's scale and min."""
    _, scale, mn = quantize_groupwise(w, group_size)
    per_group = 0.5 * scale + 15 * scale * 2**-11 + mn.abs() * 2**-11
    return per_group.repeat_interleave(group_size, dim=1)


def test_dequantized_weight_within_half_step():
    w = torch.randn(64, 256)
    assert ((dequantize_groupwise(*quantize_groupwise(w, 32)) - w).abs() <= step_bound(w, 32)).all()


@pytest.mark.parametrize("backend,group_size", CASES)
@pytest.mark.parametrize("m", [1, 3, 16, 70])
def test_output_within_quantization_step_of_float_matmul(backend, group_size, m):
    torch.manual_seed(m)
    w, b = torch.randn(96, 256) * 0.05, torch.randn(96)
    layer = Int4Linear.from_weight(w, b, group_size, backend=backend)
    x = torch.randn(m, 256)
    bound = x.abs() @ step_bound(w, group_size).T + 1e-4 * (x.abs() @ w.abs().T)
    if backend == "native":  # x rounded to int8 in blocks of 32: at most half a step (amax / 127) per element
        half_step = (x.reshape(m, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(x.shape)
        bound = bound + half_step @ dequantize_groupwise(*quantize_groupwise(w, 32)).abs().T
    assert ((layer(x) - (x @ w.T + b)).abs() <= bound).all()


@pytest.mark.skipif(not native_fits(4, 64, 32), reason="no AVX2 kernels")
@pytest.mark.skipif(not native_fits(4, 64, 32), reason="no AVX2 kernels")
def test_native_packing_writes_the_bytes_of_the_strided_moves(monkeypatch):
    # quant.cpp's q4_pack against pack_native's byte moves, from strided views as a GGUF file's Q4_0 blocks are:
    # 18-byte blocks (fp16 d, 16 bytes of nibbles), rows and blocks strided, mins computed (-8 d).
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (12, 2 * 8, 18), dtype=torch.uint8, generator=g)[:, ::2]
    raw[..., 1] &= 0x3B  # finite fp16 scales
    d = raw[..., 0:2].view(torch.float16)[..., 0]
    qs, mn = raw[..., 2:], -8 * d
    native = int4.pack_native(qs, d, mn)
    monkeypatch.setattr(int4, "native_ops", lambda: None)
    assert torch.equal(native, int4.pack_native(qs, d, mn))


def test_native_row_does_not_depend_on_how_many_rows_share_the_call():
    """The kernel takes 1, 2, 4 or 8 rows per pass, and from 16 rows the tiled kernel (AMX, else VNNI over the tiles'
    layout) takes blocks of 32 weight rows (here 64 of the 72; the VNNI kernel the rest): a verify step, a prompt chunk
    and a batch must reproduce decode steps bit for bit."""
    torch.manual_seed(0)
    layer = Int4Linear.from_weight(torch.randn(72, 320), torch.randn(72), 32, backend="native")
    x = torch.randn(70, 320)
    for m in (1, 2, 3, 5, 8, 9, 15, 16, 17, 23, 33, 70):
        y = layer(x[:m])
        assert all(torch.equal(y[i], layer(x[i:i + 1])[0]) for i in range(m)), m


@pytest.mark.parametrize("backend", ["aten", NATIVE, LUT])
def test_batched_and_bfloat16_inputs(backend):
    layer = Int4Linear.from_weight(torch.randn(32, 64), group_size=32, backend=backend)
    x = torch.randn(2, 5, 64)
    y = layer(x)
    assert y.shape == (2, 5, 32)
    assert torch.allclose(y[1, 3], layer(x[1, 3:4])[0], atol=1e-5)
    yb = layer(x.bfloat16())
    assert yb.dtype == torch.bfloat16 and torch.allclose(yb.float(), y, rtol=0.05, atol=0.3)


def test_native_weight_bytes_are_five_bits_a_weight_plus_float_bias():
    if not native_fits(32, 64, 32):
        pytest.skip("no AVX2 kernels")
    layer = quantize_linear(nn.Linear(64, 32, bias=True), "int4", 32, "native")
    assert layer.bias.dtype == torch.float32
    assert layer.weight_bytes() == 32 * 64 // 2 + 32 * 2 * 2 * 2 + 32 * 4  # nibbles, fp16 scale and min per 32, bias


@pytest.mark.parametrize("backend", ["aten", NATIVE, LUT])
def test_quantized_model_agrees_with_float_model(backend):
    model = tiny_model(tied=False)
    tokens = torch.randint(0, 128, (4, 32))
    ref = logits(model, tokens)
    quantized = quantize_model(copy.deepcopy(model), "int4", backend=backend, lm_head_scheme="int4")
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    out = logits(quantized, tokens)
    # A random untied model has close top-2 logits; 4-bit noise (~6.5% of the logits) flips about one in ten.
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85
    assert (out - ref).norm() / ref.norm() < 0.1
    assert weight_bytes(quantized) < weight_bytes(model) / 5


@pytest.mark.parametrize("backend,atol", [("aten", 1e-4), pytest.param("native", 0.05, marks=NATIVE.marks),
                                         pytest.param("lut", 1e-4, marks=NO_LUT)])
def test_quantized_model_equals_float_model_with_dequantized_weights(backend, atol):
    # The float model's error comes only from the weights (and, native, int8 activations), not from the kernel.
    model = tiny_model(tied=False)
    dequantized = copy.deepcopy(model)
    for m in dequantized.modules():
        if isinstance(m, nn.Linear):
            m.weight.data = dequantize_groupwise(*quantize_groupwise(m.weight, 32))
    tokens = torch.randint(0, 128, (2, 16))
    ref = logits(dequantized, tokens)
    out = logits(quantize_model(model, "int4", backend=backend, lm_head_scheme="int4"), tokens)
    assert (out - ref).abs().max() <= atol * ref.abs().max()


@pytest.mark.parametrize("head", ["int4", "int8"])
def test_tied_lm_head_is_quantized_and_the_embedding_is_not(head):
    model = tiny_model(tied=True)
    table = model.embed_tokens.weight.detach().clone()
    tokens = torch.randint(0, 128, (2, 16))
    ref = logits(model, tokens)
    quantize_model(model, "int4", lm_head_scheme=head)
    assert isinstance(model.lm_head, Int4Linear if head == "int4" else Int8Linear)
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    assert model.embed_tokens.weight.dtype == torch.float32 and torch.equal(model.embed_tokens.weight, table)
    out = logits(model, tokens)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9  # tied: the token's own row dominates
    assert (out - ref).norm() / ref.norm() < 0.1


def test_shapes_no_kernel_takes_stay_float():
    model = nn.Sequential(nn.Linear(64, 10), nn.Linear(10, 64))  # out 10: neither int4 kernel; in 10: not a group
    quantize_model(model, "int4")
    assert all(type(m) is nn.Linear for m in model)


def test_group_wider_than_a_row_multiple_takes_a_shorter_last_group():
    # SmolLM2's 576 inputs with groups of 128: four whole groups and one of 64, padded with its own last column.
    torch.manual_seed(0)
    w, x = torch.randn(32, 96), torch.randn(5, 96)
    assert Int4Linear.fits(32, 96, 64)
    layer = Int4Linear.from_weight(w, group_size=64, backend="aten")
    padded = torch.cat([w, w[:, -1:].expand(-1, 32)], dim=1)
    _, scale, mn = quantize_groupwise(padded, 64)
    assert torch.equal(scale[:, 1], ((w[:, 64:].amax(1) - w[:, 64:].amin(1)) / 15).half().float())
    w_hat = dequantize_groupwise(*quantize_groupwise(padded, 64))[:, :96]
    assert torch.allclose(layer(x), x @ w_hat.T, atol=1e-4)
    assert ((w_hat - w).abs() <= step_bound(padded, 64)[:, :96]).all()


@pytest.mark.skipif(lut_ops() is None, reason="no AVX2 lookup kernel")
@pytest.mark.parametrize("group_size", [32, 128])
def test_lookup_kernel_and_dequantized_gemm_agree_across_the_row_threshold(group_size):
    # Up to max_rows input rows run the kernel, more the dequantize + GEMM path: the same weights either way.
    torch.manual_seed(1)
    layer = Int4Linear.from_weight(torch.randn(48, 96), torch.randn(48), group_size, backend="lut")
    padded = 128 if group_size == 128 else 96  # 96 inputs: 3 groups of 32, or one of 128 (the last input repeated)
    assert layer.weight_bytes() == 48 * padded // 2 + 2 * 48 * (padded // group_size) * 2 + 48 * 4
    x = torch.randn(lut_ops().max_rows + 1, 96)
    assert torch.allclose(layer(x[:-1]), layer(x)[:-1], atol=1e-5)
