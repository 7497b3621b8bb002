"""Model descriptions: the catalog against published parameter counts, config.json and GGUF readers."""
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from fastdecode.errors import FastdecodeError
from fastdecode.loading.catalog import cached_path
from fastdecode.roofline.models import UnknownModelError, bits_per_weight, from_hf_config, get_model, load_catalog

CATALOG = load_catalog()
# the file `fastdecode pull smollm2-135m` fetches, or a copy left in /tmp/models
SMOLLM_GGUF = next((p for p in (cached_path("smollm2-135m"), Path("/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
                    if p.exists()), Path("missing.gguf"))
GEOMETRY = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "heads_dim",
            "intermediate_size", "vocab_size", "tie_word_embeddings", "num_experts", "num_experts_per_tok")


def test_catalog_holds_the_issues_models():
    for name in ("llama-3.1-8b", "llama-3.3-70b", "qwen2.5-coder-7b", "qwen2.5-coder-32b", "qwen3-coder-30b-a3b",
                 "kimi-k2", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b", "smollm2-135m"):
        assert name in CATALOG and CATALOG[name].source.startswith("https://")


@pytest.mark.parametrize("name, total, active", [
    ("llama-3.1-8b", 8.03e9, None),
    ("llama-3.3-70b", 70.6e9, None),
    ("qwen2.5-coder-7b", 7.61e9, None),
    ("deepseek-v3", 671e9, 37e9),  # DeepSeek's own counts
    ("kimi-k2", 1.04e12, 32e9),
    ("qwen3-coder-30b-a3b", 30.5e9, 3.3e9),  # Qwen counts the input embedding as active too: 3.35 B
    ("gpt-oss-120b", 116.8e9, 5.13e9),
    ("gpt-oss-20b", 20.9e9, 3.61e9),
    ("smollm2-135m", 134.5e6, None),
])
def test_parameter_counts_match_published_figures(name, total, active):
    model = CATALOG[name]
    assert model.total_params() == pytest.approx(total, rel=0.015)
    if active:  # vendors differ on counting the embedding table as active; ours counts the LM head only
        assert model.active_params() == pytest.approx(active, rel=0.1)


def test_bits_per_weight_knows_plain_and_gguf_formats():
    assert bits_per_weight("bf16") == 16 and bits_per_weight("fp4") == 4.25 and bits_per_weight("int4", 64) == 4.5
    assert bits_per_weight("q4_1") == 5.0 and bits_per_weight("Q8_0") == 8.5  # 32 weights in 20 / 34 bytes
    with pytest.raises(FastdecodeError):
        bits_per_weight("int3")


def test_hf_config_of_a_dense_model_matches_the_catalog(tmp_path):
    config = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = get_model(str(tmp_path))  # a folder holding config.json
    assert all(getattr(model, f) == getattr(CATALOG["llama-3.1-8b"], f) for f in GEOMETRY)
    assert model.weight_bytes() == CATALOG["llama-3.1-8b"].weight_bytes()


def test_hf_config_of_mla_moe_and_mxfp4_models(tmp_path):
    deepseek = {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                "num_experts_per_tok": 8, "n_shared_experts": 1, "first_k_dense_replace": 3, "q_lora_rank": 1536,
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "vocab_size": 129280, "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "ds.json").write_text(json.dumps(deepseek))
    model = from_hf_config(tmp_path / "ds.json")
    assert model.mla and model.dtype == "fp8" and model.params() == CATALOG["deepseek-v3"].params()
    gpt_oss = {"hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
               "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 32, "experts_per_token": 4,
               "vocab_size": 201088, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12,
               "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "oss.json").write_text(json.dumps(gpt_oss))
    model = from_hf_config(tmp_path / "oss.json")
    assert model.expert_dtype == "fp4" and model.sliding_layers == 12
    assert model.weight_bytes() == CATALOG["gpt-oss-20b"].weight_bytes()


def _write_gguf(path: Path) -> dict[str, int]:
    """A tiny two-layer MoE in GGUF: tied embeddings, Q8_0 and F32 tensors. Returns each tensor's byte size."""
    w = GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 2), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("attention.head_count", 4), ("attention.head_count_kv", 2), ("vocab_size", 100),
                       ("expert_count", 4), ("expert_used_count", 2)):
        w.add_uint32(f"llama.{key}", value)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": quantize(rng.standard_normal((100, 32), dtype=np.float32),
                                             GGMLQuantizationType.Q8_0)}
    for i in range(2):
        tensors[f"blk.{i}.attn_q.weight"] = rng.standard_normal((32, 32), dtype=np.float32)
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(32, dtype=np.float32)
        tensors[f"blk.{i}.ffn_gate_inp.weight"] = rng.standard_normal((4, 32), dtype=np.float32)
        tensors[f"blk.{i}.ffn_up_exps.weight"] = rng.standard_normal((4, 16, 32), dtype=np.float32)
    for name, array in tensors.items():
        quantized = name == "token_embd.weight"
        w.add_tensor(name, array, raw_dtype=GGMLQuantizationType.Q8_0 if quantized else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {name: a.nbytes for name, a in tensors.items()}


def test_gguf_bytes_per_token_are_exact_tensor_bytes(tmp_path):
    sizes = _write_gguf(tmp_path / "tiny.gguf")
    model = get_model(str(tmp_path / "tiny.gguf"))
    assert model.tie_word_embeddings and model.num_experts == 4 and model.gguf.format
    experts = sum(n for name, n in sizes.items() if "_exps" in name)
    embedding = sizes["token_embd.weight"]  # 100 rows of 34 bytes: the tied LM head reads it all
    dense = sum(sizes.values()) - experts - embedding
    assert model.weight_bytes() == dense + embedding + experts * 2 / 4 + embedding // 100
    assert model.weight_bytes(tokens=3) == dense + embedding + experts * (1 - 0.5**3) + embedding // 100
    assert model.resident_weight_bytes() == sum(sizes.values())


@pytest.mark.skipif(not SMOLLM_GGUF.exists(), reason="needs the SmolLM2-135M Q4_1 GGUF")
def test_smollm2_catalog_entry_matches_the_real_gguf():
    real, catalog = get_model(str(SMOLLM_GGUF)), CATALOG["smollm2-135m"]
    assert all(getattr(real, f) == getattr(catalog, f) for f in GEOMETRY)
    assert real.total_params() == catalog.total_params() == 134_515_008
    assert real.weight_bytes() == 96_576_768 + 612  # every tensor once (tied head) + one Q8_0 embedding row
    assert real.gguf.format == "Q4_1"


def test_unknown_model_is_a_user_error():
    with pytest.raises(UnknownModelError):
        get_model("no-such-model")
