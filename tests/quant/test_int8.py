"""Int8Linear against the float matmul, within bounds derived from the quantization steps, and quantize_model("int8")
on a tiny random Transformer against the float model. The native backend encodes per block of 32 (asymmetric or
symmetric, whichever fits the block better); the aten one scales per output channel."""
import copy

import pytest
import torch
from torch import nn

from fastdecode.quant import Int8Linear, int8, quantize_linear, quantize_model, weight_bytes
from fastdecode.quant.int8 import dequantize_blockwise, native_fits, quantize_blockwise, quantize_per_channel
from tests.helpers.tiny import logits, tiny_model

NATIVE = pytest.mark.skipif(not native_fits(4, 32), reason="no AVX2 kernels")
BACKENDS = ["aten", pytest.param("native", marks=NATIVE)]


def weight_error(w: torch.Tensor, backend: str) -> torch.Tensor:
    """The worst error of every weight. Native: a block takes the better of two encodings,
    so its error is at most the worse of their bounds. Symmetric: half a step d = amax / 127, plus 127 d 2^-11 where
    the fp16 d rounds down and clips the largest values. Asymmetric: half a step d = range / 255, plus 255 d 2^-11
    for d's rounding and 2^-11 |min| for the offset's. Aten: half a step, the step being per row."""
    if backend == "native":
        g = w.reshape(w.shape[0], -1, 32)
        d_sym, d_asym = g.abs().amax(-1) / 127, (g.amax(-1) - g.amin(-1)) / 255
        bound = torch.maximum(d_sym / 2 + 127 * d_sym * 2**-10,
                              d_asym / 2 + 255 * d_asym * 2**-10 + g.amin(-1).abs() * 2**-10)
        return bound.repeat_interleave(32, dim=1)
    _, scale = quantize_per_channel(w)
    return scale[:, None].expand_as(w) / 2


@pytest.mark.parametrize("K", [128, 96])
def test_blockwise_encoding_reproduces_a_q8_0_tensor_exactly(K):
    scale = torch.rand(8, K // 32).half().float()  # what a Q8_0 GGUF tensor holds: fp16 scales, int8 values
    q = torch.randint(-128, 128, (8, K), dtype=torch.int8)
    q[:, ::32] = 127  # every block reaches its full range, as Q8_0's quantizer makes it
    w = dequantize_blockwise(q, scale)
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(w)), w)
    if native_fits(8, K):  # as a Q8_0 GGUF tensor loads: its int8 values and scales, no offsets
        kept = Int8Linear.from_tensors({"qweight": q, "scales": scale.half()}, backend="native")
        # pair tiles where K holds whole pairs of blocks, else the weight-only tiles with m = -128 d
        assert kept.qweight.shape[-1] == (272 if K % 64 == 0 else 144)
        assert torch.equal(kept.rows(torch.arange(8)), w)


def test_blockwise_encoding_holds_a_q4_1_tensor_to_fp16_rounding_of_its_scale():
    """SmolLM2's matrices are Q4_1 (w = d q + m, q in 0..15): the asymmetric encoding maps q to 17 q, so only the fp16
    rounding of d / 17 remains (2^-11 relative, or 2^-25 absolute where it is subnormal), times at most 255; a
    symmetric Q8_0 encoding re-rounds the values by up to half its step."""
    torch.manual_seed(0)
    d, m = (torch.rand(16, 8) * 0.01).half().float(), (-torch.rand(16, 8) * 0.08).half().float()
    q4 = torch.randint(0, 16, (16, 8, 32)).float()
    q4[..., 0], q4[..., 1] = 0, 15  # full range, as Q4_1's quantizer makes it
    g = q4 * d[..., None] + m[..., None]
    w = g.reshape(16, 256)
    err = (dequantize_blockwise(*quantize_blockwise(w)) - w).abs().reshape(16, 8, 32)
    assert (err <= 255 * torch.maximum(d / 17 * 2**-11, torch.tensor(2**-25))[..., None] * 1.001).all()
    step_sym = g.abs().amax(-1, keepdim=True) / 127
    err_sym = ((g / step_sym).round() * step_sym - g).abs()
    assert err.mean() < err_sym.mean() / 10


def activation_step_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The error of rounding x to int8 per block of 32 (at most half a step, amax / 254, per element) through |w|, plus
    float rounding."""
    m, K = x.shape
    half_step = (x.reshape(m, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(m, K)
    return half_step @ w.abs().T + 1e-4 * (x.abs() @ w.abs().T)


@NATIVE
@pytest.mark.parametrize("m", [1, 5, 40])  # 40: the tiled kernel (AMX, else VNNI)
def test_native_kernel_computes_with_the_encoded_weights_in_both_layouts(m):
    """A Q8_0 tensor goes into pair tiles (272 bytes per tile and pair of blocks) and is computed with int8
    activations, as llama.cpp does; anything else into weight-only tiles (144 bytes per tile and block), float
    activations."""
    torch.manual_seed(m)
    x = torch.randn(m, 128)
    scale = (torch.rand(32, 4) * 0.01).half().float()
    q = torch.randint(-128, 128, (32, 128), dtype=torch.int8)
    q8_0 = Int8Linear.from_tensors({"qweight": q, "scales": scale.half()}, backend="native")
    assert q8_0.qweight.shape == (8, 2, 272)
    w = dequantize_blockwise(q, scale)
    assert ((q8_0(x) - x @ w.T).abs() <= activation_step_bound(x, w)).all()
    w = torch.randn(32, 128) * 0.05 + 0.03
    layer = Int8Linear.from_weight(w, backend="native")
    assert layer.qweight.shape == (8, 4, 144)
    torch.testing.assert_close(layer(x), x @ dequantize_blockwise(*quantize_blockwise(w)).T, rtol=1e-5, atol=1e-5)


@NATIVE
@pytest.mark.parametrize("symmetric", [True, False])
def test_native_row_does_not_depend_on_how_many_rows_share_the_call(symmetric):
    """Weight-only: up to 5 rows are computed from weights dequantized in registers, more from a dequantized copy of the
    tile (on AVX-512, of two tiles at once; 11 tiles leave one alone). Pair tiles: up to 4 rows a pass, and from 16 rows
    the tiled kernel (AMX, else VNNI over the tiles' layout) takes blocks of 32 weight rows (here 32 of the 44). A
    verify step must reproduce decode steps bit for bit either way."""
    torch.manual_seed(0)
    if symmetric:
        q = torch.randint(-128, 128, (44, 320), dtype=torch.int8)
        layer = Int8Linear.from_tensors({"qweight": q, "scales": torch.rand(44, 10).half()}, torch.randn(44), "native")
    else:
        layer = Int8Linear.from_weight(torch.randn(44, 320), torch.randn(44), backend="native")
    assert layer.qweight.shape[-1] == (272 if symmetric else 144)
    x = torch.randn(40, 320)
    for m in (1, 2, 3, 4, 5, 6, 7, 9, 15, 16, 17, 20, 33, 40):
        y = layer(x[:m])
        assert all(torch.equal(y[i], layer(x[i:i + 1])[0]) for i in range(m)), m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 16, 70])
def test_output_within_quantization_step_of_float_matmul(backend, m):
    torch.manual_seed(m)
    w, b = torch.randn(96, 128) * 0.05, torch.randn(96)
    layer = Int8Linear.from_weight(w, b, backend=backend)
    x = torch.randn(m, 128)
    err = weight_error(w, backend)
    bound = x.abs() @ err.T + 1e-4 * (x.abs() @ w.abs().T)  # the second term: float rounding
    assert ((layer(x) - (x @ w.T + b)).abs() <= bound).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_input_keeps_its_shape_and_rows(backend):
    layer = Int8Linear.from_weight(torch.randn(32, 64), backend=backend)
    x = torch.randn(2, 5, 64)
    y = layer(x)
    assert y.shape == (2, 5, 32)
    assert torch.allclose(y[1, 3], layer(x[1, 3:4])[0], atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_input_gives_bfloat16_output(backend):
    layer = Int8Linear.from_weight(torch.randn(32, 64), backend=backend)
    x = torch.randn(3, 64)
    y = layer(x.bfloat16())
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), layer(x), rtol=0.05, atol=0.3)


@pytest.mark.parametrize("backend,scale_bytes", [("aten", 32 * 4), pytest.param("native", 32 * 2 * 4, marks=NATIVE)])
def test_bias_stays_float32_and_weight_bytes_count_int8_scales_and_offsets(backend, scale_bytes):
    layer = quantize_linear(nn.Linear(64, 32, bias=True), "int8", backend=backend)
    assert layer.bias.dtype == torch.float32
    assert layer.weight_bytes() == 32 * 64 + scale_bytes + 32 * 4  # int8 weight, its scales, float bias


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_model_agrees_with_float_model(backend):
    model = tiny_model(tied=False)
    tokens = torch.randint(0, 128, (4, 32))
    ref = logits(model, tokens)
    quantized = quantize_model(copy.deepcopy(model), "int8", backend=backend)
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    out = logits(quantized, tokens)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
    assert (out - ref).norm() / ref.norm() < 0.02
    assert weight_bytes(quantized) < weight_bytes(model) / 3


def test_tied_lm_head_is_quantized_and_the_embedding_is_not():
    model = tiny_model(tied=True)
    table = model.embed_tokens.weight.detach().clone()
    tokens = torch.randint(0, 128, (2, 16))
    ref = logits(model, tokens)
    quantize_model(model, "int8")
    assert isinstance(model.lm_head, Int8Linear)
    assert model.embed_tokens.weight.dtype == torch.float32 and torch.equal(model.embed_tokens.weight, table)
    out = logits(model, tokens)
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95
    assert (out - ref).norm() / ref.norm() < 0.02


@NATIVE
def test_native_pair_packing_writes_the_bytes_of_the_strided_moves(monkeypatch):
    # quant.cpp's q8_pack against pack_pairs' byte moves, from strided views as a GGUF file's Q8_0 blocks are
    # (34 bytes: fp16 d, 32 int8), rows and blocks strided.
    g = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 256, (12, 2 * 8, 34), dtype=torch.uint8, generator=g)[:, ::2]
    raw[..., 1] &= 0x3B  # finite fp16 scales
    d, q = raw[..., 0:2].view(torch.float16)[..., 0], raw[..., 2:].view(torch.int8)
    native = int8.pack_pairs(q, d)
    monkeypatch.setattr(int8, "native_ops", lambda: None)
    assert torch.equal(native, int8.pack_pairs(q, d))
