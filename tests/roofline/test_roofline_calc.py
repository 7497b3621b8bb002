"""Hand-computed roofline cases: each expected figure is worked out from the model geometry in the comments."""
import math

import pytest

from fastdecode.roofline import Scenario, ScenarioError, roofline
from fastdecode.roofline.hardware import load_catalog as load_hardware
from fastdecode.roofline.models import load_catalog as load_models

HW, MODELS = load_hardware(), load_models()
# Llama 3.1 8B, weights one token reads: per layer attention 4096*128*(2*32+2*8) = 41,943,040, MLP 3*4096*14336 =
# 176,160,768, norms 8,192; x32 layers = 6,979,584,000; + final norm 4,096 + LM head 128,256*4,096 = 525,336,576.
LLAMA8B_READ = 7_504_924_672
LLAMA8B_ROW = 4096  # the one embedding row an input token reads


def test_llama_8b_bf16_on_h200_reads_about_16_gb_and_decodes_about_300_tok_s():
    r = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="bf16", context=0))
    assert r.bytes_per_token == (LLAMA8B_READ + LLAMA8B_ROW) * 2  # 15.0 GB: the "about 16 GB"
    assert r.decode_tok_s_ceiling == pytest.approx(4.8e12 / r.bytes_per_token)  # 320 tok/s
    assert 290 < r.decode_tok_s_ceiling < 330 and r.bound == "memory"
    assert r.chips == 1 and r.fits


def test_int4_weights_cost_4_25_bits_with_group_128_scales():
    r = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="int4", context=0))
    assert r.bytes_per_token == pytest.approx((LLAMA8B_READ + LLAMA8B_ROW) * 4.25 / 8)  # 3.99 GB
    assert r.decode_tok_s_ceiling == pytest.approx(1204, rel=1e-3)
    g32 = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="int4", group_size=32, context=0))
    assert g32.bytes_per_token == pytest.approx((LLAMA8B_READ + LLAMA8B_ROW) * 5 / 8)  # gpt-fast's G=32: 5 bits


def test_tensor_parallel_divides_bytes_and_adds_two_all_reduces_per_layer():
    # Llama 3.3 70B reads 69,503,033,344 weights (+ an 8,192 row) in bf16; 8 H200s each read an eighth.
    r = roofline(Scenario(MODELS["llama-3.3-70b"], HW["h200"], dtype="bf16", context=0, tp=8))
    memory_s = (69_503_033_344 + 8192) * 2 / 8 / 4.8e12
    allreduce_s = 2e-6 * 3 + 2 * 7 / 8 * (8192 * 2) / 450e9  # 3 steps of 2 us, then 16 KB over 450 GB/s
    comm_s = (2 * 80 + 1) * allreduce_s  # attention and MLP outputs per layer, and the logits
    assert r.step["memory_s"] == pytest.approx(memory_s)
    assert r.step["comm_s"] == pytest.approx(comm_s)
    assert r.decode_tok_s_ceiling == pytest.approx(1 / (memory_s + comm_s))  # 219 tok/s, not 8 x 34
    assert (r.tp, r.pp, r.chips_needed) == (8, 1, 2)


def test_moe_reads_only_the_active_experts():
    # Qwen3-Coder-30B-A3B per layer: attention 2048*128*72 = 18,874,368, router 262,144, norms 4,096, and 8 of
    # 128 experts of 3*2048*768: 37,748,736; x48 = 2,730,688,512; + final norm 2,048 + head 151,936*2,048.
    model = MODELS["qwen3-coder-30b-a3b"]
    active = 2_730_688_512 + 2048 + 311_164_928
    assert model.active_params() == active  # 3.0 B of 30.5 B
    r = roofline(Scenario(model, HW["h200"], dtype="bf16", context=0))
    assert r.bytes_per_token == (active + 2048) * 2
    assert r.bytes_per_token < 0.11 * model.total_params() * 2


def test_moe_verify_of_several_tokens_touches_more_experts():
    model = MODELS["qwen3-coder-30b-a3b"]
    assert model.expert_fraction(1) == 8 / 128
    assert model.expert_fraction(5) == pytest.approx(1 - (120 / 128) ** 5)  # 28% of experts for 5 tokens
    r = roofline(Scenario(model, HW["h200"], dtype="bf16", accept_length=3, draft_tokens=4))
    assert r.speculation_multiplier < 1.2  # the verifier reads ~3x the bytes: speculation barely pays


def test_weights_that_must_fit_in_sram_need_many_chips():
    # Llama 3.3 70B: 70,553,706,496 parameters in bf16, plus KV 80*2*8*128*2 B = 327,680 B per token of context.
    resident = 70_553_706_496 * 2 + 327_680 * 1024
    groq = roofline(Scenario(MODELS["llama-3.3-70b"], HW["groq-lpu"], dtype="bf16", context=1024))
    assert groq.chips_needed == math.ceil(resident / 0.23e9) == 615  # 230 MB of SRAM each
    assert groq.tp == 615 and groq.fits
    wafer = roofline(Scenario(MODELS["llama-3.3-70b"], HW["wse-3"], dtype="bf16", context=1024))
    assert (wafer.tp, wafer.pp, wafer.chips_needed) == (1, 4, 4)  # 44 GB wafers, one pipeline stage each


def test_kv_cache_at_long_context_outweighs_the_weights():
    # 32 layers x (K and V) x 8 KV heads x 128 x 2 bytes = 131,072 B per token; 128k tokens = 17.2 GB.
    r = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="bf16", context=131072))
    assert r.kv_bytes_per_token == 131_072 * 131_072
    assert r.kv_bytes_per_token > r.weight_bytes_per_token
    assert r.decode_tok_s_ceiling == pytest.approx(4.8e12 / ((LLAMA8B_READ + LLAMA8B_ROW) * 2 + 131_072**2))


def test_mla_and_sliding_window_shrink_the_kv_cache():
    # DeepSeek-V3 caches one 512 + 64 latent per layer: 61 * 576 * 2 B per token.
    assert MODELS["deepseek-v3"].kv_bytes(1000) == 61 * 576 * 2 * 1000
    # gpt-oss-120b: 18 full layers, 18 that keep the last 128 tokens; 2 * 8 * 64 elements per layer-token.
    assert MODELS["gpt-oss-120b"].kv_bytes(10_000) == 2 * 8 * 64 * 2 * (18 * 10_000 + 18 * 128)


def test_cost_per_million_tokens_is_chip_hours_over_tokens():
    r = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="bf16", context=0, price_per_hour=3.6))
    assert r.cost_per_million_tokens == pytest.approx(3.6 / 3600 * 1e6 / r.decode_tok_s_ceiling)  # $3.13
    catalog_price = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="bf16", context=0))
    assert catalog_price.cost_per_million_tokens == pytest.approx(4.54 / 3600 * 1e6 / 319.78, rel=1e-3)
    assert roofline(Scenario(MODELS["llama-3.1-8b"], HW["wse-3"])).cost_per_million_tokens is None  # no price


def test_speculation_multiplies_a_memory_bound_step():
    plain = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="bf16"))
    spec = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="bf16", accept_length=3, draft_cost=0.1))
    # 5 tokens verified in one read of the weights; the drafter costs a tenth of a step: 3 / 1.1
    assert spec.speculation_multiplier == pytest.approx(3 / 1.1)
    assert spec.decode_tok_s_ceiling == pytest.approx(plain.decode_tok_s_ceiling * 3 / 1.1)


def test_speculation_cannot_accept_more_than_it_drafts():
    with pytest.raises(ScenarioError):
        roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], accept_length=6, draft_tokens=3))


def test_ttft_of_a_long_prompt_is_compute_bound():
    # 2 FLOPs per weight per token (the LM head's for the last token only: only it samples) plus causal attention:
    # 32 layers x 2*32*2*128 per (query, key) pair.
    head = 128256 * 4096
    flops = 2 * (LLAMA8B_READ - head) * 1024 + 2 * head + 32 * 16384 * 1024 * 1025 / 2
    r = roofline(Scenario(MODELS["llama-3.1-8b"], HW["h200"], dtype="bf16", prompt=1024))
    assert r.prefill_bound == "compute"
    assert r.ttft_s == pytest.approx(flops / 989e12)  # 14.7 ms


def test_hardwired_chip_is_limited_by_pipeline_depth_not_bytes():
    r = roofline(Scenario(MODELS["llama-3.1-8b"], HW["taalas-hc1"]))
    assert r.bound == "latency" and r.weight_bytes_per_token == 0
    assert r.decode_tok_s_ceiling == pytest.approx(17_000, rel=1e-3)  # calibrated on its published speed
    big = roofline(Scenario(MODELS["llama-3.3-70b"], HW["taalas-hc1"]))
    assert big.chips == 9 and any("hypothetical" in n for n in big.notes)


def test_a_model_too_big_for_the_given_chips_is_flagged():
    r = roofline(Scenario(MODELS["llama-3.3-70b"], HW["h200"], dtype="bf16", tp=1, pp=1))
    assert not r.fits and any("does not fit" in n for n in r.notes)
