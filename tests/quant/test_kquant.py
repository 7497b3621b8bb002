"""KQuantLinear: GGUF K-quant blocks repacked without a value changing (against gguf's own dequantization), the
native kernel against dequantize + float matmul, and each output row independent of the rows beside it."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize as gguf_dequantize

from fastdecode.quant import KQuantLinear, kquant
from fastdecode.quant.kquant import FILE_BYTES, TILE_BYTES, native_fits
from tests.helpers.kquant_blocks import quantize, random_blocks

KINDS = {"q4_k": QType.Q4_K, "q5_k": QType.Q5_K, "q6_k": QType.Q6_K}
NATIVE = pytest.mark.skipif(not native_fits(4, 256), reason="no AVX2 kernels")


def blocks(kind: str, N: int, K: int, seed: int = 0, d_range=(1e-3, 1e-2)) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(random_blocks(KINDS[kind], N * K // 256, rng, d_range).reshape(N, K // 256, -1))


def gguf_weight(b: torch.Tensor, kind: str) -> torch.Tensor:
    N, S, _ = b.shape
    return torch.from_numpy(gguf_dequantize(b.reshape(N * S, -1).numpy(), KINDS[kind]).reshape(N, S * 256).copy())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d_range", [(1e-3, 1e-2), None], ids=["typical", "extreme"])
def test_packed_blocks_dequantize_to_ggufs_values_bit_for_bit(kind, d_range):
    # Random bytes are valid blocks: every scale, min and value pattern; "extreme" draws d (and dmin) from all finite
    # fp16 values, +-65504, subnormals and zero included.
    b = blocks(kind, 32, 1024, seed=1, d_range=d_range)
    layer = KQuantLinear(b, kind, backend="dequant")
    assert layer.qweight.shape == (8, 4, TILE_BYTES[kind])
    assert torch.equal(layer.dequantize(), gguf_weight(b, kind))


@NATIVE
@pytest.mark.parametrize("kind", ["q4_k", "q5_k"])
def test_native_packing_writes_the_bytes_of_the_pytorch_packing(monkeypatch, kind):
    # kquant.cpp's kq_pack against pack()'s own torch ops, on a strided view of the blocks (as a file's rows are)
    wide = blocks(kind, 12, 768, seed=2, d_range=None)
    b = torch.cat([wide, wide], dim=1)[:, ::2]  # rows and super-blocks strided, each super-block's bytes contiguous
    native = kquant.pack(b, kind)
    monkeypatch.setattr(kquant, "native_ops", lambda: None)
    assert torch.equal(native, kquant.pack(b, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_test_writer_blocks_follow_the_weights(kind):
    # The tiny K-quant GGUFs other tests load are written by tests.helpers.kquant_blocks: within a step of the weights.
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    back = gguf_dequantize(quantize(w, KINDS[kind]), KINDS[kind]).reshape(w.shape)
    assert np.abs(back - w).max() < 0.1 * np.abs(w).max()


def half_step_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The kernel rounds each activation to int8 per block of 32: at most half a step (amax / 127 / 2) an element;
    plus float rounding of the sums."""
    M, K = x.shape
    step = x.reshape(M, -1, 32).abs().amax(-1, keepdim=True) / 127
    half = (step / 2).expand(-1, -1, 32).reshape(M, K)
    return half @ w.abs().T + 1e-5 * (x.abs() @ w.abs().T)


@NATIVE
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 17])
def test_native_output_within_activation_rounding_of_dequantized_matmul(kind, m):
    torch.manual_seed(m)
    b, bias = blocks(kind, 40, 768, seed=m), torch.randn(40)
    layer = KQuantLinear(b, kind, bias, backend="native")
    w, x = gguf_weight(b, kind), torch.randn(m, 768)
    reference = x.double() @ w.double().T + bias.double()
    err = (layer(x).double() - reference).abs()
    assert (err <= half_step_bound(x, w).double()).all()
    # and far inside it: the bound is a worst case, the rounding errors of 768 activations mostly cancel
    assert err.max() < 0.2 * half_step_bound(x, w).max()


@NATIVE
@pytest.mark.parametrize("kind", KINDS)
def test_native_row_does_not_depend_on_how_many_rows_share_the_call(kind):
    """Q4_K/Q5_K: 1 or 2 rows take all 4 weight rows in one pass, groups of 4 and 8 a pass per weight row, and from 16
    rows the tiled kernel (AMX, else VNNI over the tiles' layout) takes blocks of 32 weight rows (64 of the 72; the VNNI
    kernel the rest); Q6_K calls of up to 8 rows: a verify step, a prompt chunk or a batch must reproduce decode steps
    bit for bit."""
    torch.manual_seed(0)
    layer = KQuantLinear(blocks(kind, 72, 512), kind, torch.randn(72), backend="native")
    x = torch.randn(70, 512)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(70)])
    for m in (*range(1, 10), 15, 16, 17, 23, 33, 70):
        assert torch.equal(layer(x[:m]), alone[:m]), m


@pytest.mark.parametrize("kind", KINDS)
def test_dequant_backend_is_the_float_matmul_of_the_files_weights(kind):
    b, bias = blocks(kind, 16, 512), torch.randn(16)
    layer = KQuantLinear(b, kind, bias, backend="dequant")
    x = torch.randn(2, 3, 512)
    assert torch.allclose(layer(x), x @ gguf_weight(b, kind).T + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["dequant", pytest.param("native", marks=NATIVE)])
@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_the_files_rows(kind, backend):
    b = blocks(kind, 12, 512)
    layer = KQuantLinear(b, kind, backend=backend)
    ids = torch.tensor([0, 5, 11, 3, 3])
    assert torch.equal(layer.rows(ids), gguf_weight(b, kind)[ids])


@NATIVE
def test_batched_and_bfloat16_inputs():
    layer = KQuantLinear(blocks("q4_k", 8, 256), "q4_k", backend="native")
    x = torch.randn(2, 5, 256)
    y = layer(x)
    assert y.shape == (2, 5, 8) and torch.equal(y[1, 3], layer(x[1, 3:4])[0])
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", KINDS)
def test_weight_bytes_are_the_files_plus_the_unpacked_scales(kind):
    layer = KQuantLinear(blocks(kind, 8, 512), kind, backend="dequant")
    assert layer.weight_bytes() == 8 * 2 * TILE_BYTES[kind] // 4
    assert layer.weight_bytes() <= 8 * 2 * FILE_BYTES[kind] * 1.04


def test_shapes_no_tile_takes_are_refused():
    with pytest.raises(ValueError, match="N % 4"):
        KQuantLinear(blocks("q6_k", 6, 256), "q6_k")
