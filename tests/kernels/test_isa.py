"""The kernels' two builds (jit.kernel_isa): AVX-512 with VNNI where the CPU has it, else AVX2. The wide build sums
int8 products in the same exact integers and floats in its own lane order, so it must agree with the AVX2 build to
float rounding, and the CPU's best build must be the one the package uses."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastdecode.kernels import jit, native_ops, native_ops_for
from fastdecode.loading import load_model
from fastdecode.quant import KQuantLinear, fp4, int4, int8
from tests.helpers.checkpoints import checkpoint
from tests.kernels.test_decoder import native_steps
from tests.quant.test_kquant import blocks

wide = pytest.mark.skipif(not jit.cpu_has_avx512() or native_ops() is None,
                          reason="needs a CPU with AVX-512 and VNNI, and the native kernels")


def test_the_kernels_take_the_widest_build_unless_told_to_stay_narrow(monkeypatch, caplog):
    best = "avx512" if jit.cpu_has_avx512() else "avx2"
    monkeypatch.delenv("FASTDECODE_KERNEL_ISA", raising=False)
    assert jit.kernel_isa() == best
    monkeypatch.setenv("FASTDECODE_KERNEL_ISA", "avx2")
    assert jit.kernel_isa() == "avx2"
    monkeypatch.setenv("FASTDECODE_KERNEL_ISA", "sse2")
    with caplog.at_level(logging.WARNING):
        assert jit.kernel_isa() == best
    assert "ignoring FASTDECODE_KERNEL_ISA=sse2" in caplog.text


@wide
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 40])  # 40: the tiled kernel (AMX, else VNNI)
def test_the_wide_build_computes_integer_matmuls_bit_for_bit_and_weight_only_int8_to_rounding(rows):
    narrow, wide_ops = native_ops_for("avx2"), native_ops_for("avx512")
    g = torch.Generator().manual_seed(rows)
    N, K = 64, 256
    w4 = int4.pack_native(int4.to_blocks(torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)),
                          torch.rand(N, K // 32, generator=g) * 0.01, -torch.rand(N, K // 32, generator=g) * 0.05)
    q8_0 = int8.pack_native(torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g),
                            torch.rand(N, K // 32, generator=g) * 0.01, None)  # pair tiles: int8 activations
    w8 = int8.pack_native(torch.randint(0, 256, (N, K), dtype=torch.uint8, generator=g),
                          torch.rand(N, K // 32, generator=g) * 0.01, -torch.rand(N, K // 32, generator=g) * 0.05)
    mx = fp4.pack_native(torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8, generator=g),
                         torch.randint(117, 125, (N, K // 32), dtype=torch.uint8, generator=g))
    x = torch.randn(rows, K, generator=g)
    assert torch.equal(wide_ops.fp4_linear(x, mx, None), narrow.fp4_linear(x, mx, None))
    assert torch.equal(wide_ops.q4_linear(x, w4, None), narrow.q4_linear(x, w4, None))
    assert torch.equal(wide_ops.q8_linear(x, q8_0, None), narrow.q8_linear(x, q8_0, None))
    torch.testing.assert_close(wide_ops.q8_linear(x, w8, None), narrow.q8_linear(x, w8, None), rtol=1e-5, atol=1e-5)


@wide
@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_the_wide_build_computes_k_quant_matmuls_bit_for_bit(kind, rows):
    narrow, wide_ops = native_ops_for("avx2"), native_ops_for("avx512")
    w = KQuantLinear(blocks(kind, 64, 512, seed=rows), kind, backend="native").qweight
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(wide_ops.kq_linear(x, w, None), narrow.kq_linear(x, w, None))


@wide
def test_without_amx_the_vnni_tiled_kernel_gives_the_narrow_builds_bits_too():
    """From 16 rows the wide build takes blocks of 32 weight rows on AMX tiles where it may, else with vpdpbusd over
    the tiles' layout (AMD's Zen 4, or FASTDECODE_AMX=0). The choice is made once per process, so the 40-row checks
    above run again in a process without AMX: on a CPU with it, they covered the tiles."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "bit_for_bit and 40"],
        cwd=Path(__file__).resolve().parents[2], env={**os.environ, "FASTDECODE_AMX": "0"}, capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]  # (5 had none of them run)


@wide
@pytest.mark.parametrize("name", ["llama", "mistral_window"])
def test_the_wide_build_decodes_as_the_narrow_one(name):
    """Attention in 16-float vectors (head size 16) and the whole step, the prompt's forward and the decode steps.
    Float weights: in an int4 model, a last-bit difference can flip an activation's int8 rounding, which moves
    logits by a quantization step."""
    model = load_model(checkpoint(name).hf_dir)
    _, wide_logits = native_steps(model, native_ops_for("avx512"))
    _, narrow_logits = native_steps(model, native_ops_for("avx2"))
    assert (wide_logits - narrow_logits).abs().max().item() <= 1e-4
