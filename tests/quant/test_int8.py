"""Int8Linear against the float matmul, within bounds derived from the quantization steps, and quantize_model("int8")
on a tiny random Transformer against the float model. The native backend scales per block of 32 and also rounds
activations; the aten one scales per output channel."""
import copy

import pytest
import torch
from torch import nn

from fastdecode.quant import Int8Linear, quantize_model, weight_bytes
from fastdecode.quant.int8 import dequantize_blockwise, native_fits, quantize_blockwise, quantize_per_channel
from tests.helpers.tiny import logits, tiny_model

NATIVE = pytest.mark.skipif(not native_fits(4, 32), reason="no AVX2 kernels")
BACKENDS = ["aten", pytest.param("native", marks=NATIVE)]


def activation_error_bound(x: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """Worst |x_hat @ w_hat.T - x @ w_hat.T| when x is rounded to int8 in blocks of 32 (step amax / 127): each element
    moves by at most half a step. x (M, K), w_hat (N, K) -> (M, N)."""
    step = x.reshape(x.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127
    half_step = (step / 2).expand(-1, -1, 32).reshape(x.shape)
    return half_step @ w_hat.abs().T


def weight_error(w: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the worst error of every weight, the dequantized weight). Half a step, the step being per 32-block (native)
    or per row (aten); native's fp16 scale may round down by 2^-11, clipping the block's largest values by 127 times
    that."""
    if backend == "native":
        q, scale = quantize_blockwise(w)
        step = scale.repeat_interleave(32, dim=1)
        return step / 2 + 127 * step * 2**-11, dequantize_blockwise(q, scale)
    q, scale = quantize_per_channel(w)
    return scale[:, None].expand_as(w) / 2, q.float() * scale[:, None]


def test_blockwise_scales_reproduce_a_q8_0_tensor_exactly():
    scale = torch.rand(8, 4).half().float()  # what a Q8_0 GGUF tensor holds: fp16 scales, int8 values
    q = torch.randint(-127, 128, (8, 128), dtype=torch.int8)
    q[:, ::32] = 127  # every block reaches its full range, as Q8_0's quantizer makes it
    w = dequantize_blockwise(q, scale)
    assert torch.equal(dequantize_blockwise(*quantize_blockwise(w)), w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 16, 70])
def test_output_within_quantization_step_of_float_matmul(backend, m):
    torch.manual_seed(m)
    w, b = torch.randn(96, 128) * 0.05, torch.randn(96)
    layer = Int8Linear.from_weight(w, b, backend=backend)
    x = torch.randn(m, 128)
    err, w_hat = weight_error(w, backend)
    bound = x.abs() @ err.T + 1e-4 * (x.abs() @ w.abs().T)  # the second term: float rounding
    if backend == "native":  # the kernel also rounds x to int8
        bound = bound + activation_error_bound(x, w_hat)
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


@pytest.mark.parametrize("backend,scale_bytes", [("aten", 32 * 4), pytest.param("native", 32 * 2 * 2, marks=NATIVE)])
def test_bias_stays_float32_and_weight_bytes_count_int8_and_scales(backend, scale_bytes):
    layer = Int8Linear.from_linear(nn.Linear(64, 32, bias=True), backend=backend)
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
