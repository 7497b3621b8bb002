"""Rope keys from a GGUF file or a config.json: each one layers/rotary.py reads is checked as the config is read, and a
bad one is a one-line model-file error naming it, never a traceback at the first forward pass (YaRN without its
original context) or a model that loads and writes garbage (a linear factor of 0 or NaN)."""
import math

import pytest
import torch

from fastdecode.config import ModelConfig
from fastdecode.errors import ModelFileError, UnsupportedModelError
from fastdecode.layers.rotary import rope_cache


def gguf(rope: dict) -> dict:
    """A small llama GGUF's metadata, with `rope` as its `llama.rope.*` keys."""
    return {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.block_count": 2, "llama.feed_forward_length": 128, "llama.context_length": 256,
            "llama.vocab_size": 100, **{f"llama.rope.{k}": v for k, v in rope.items()}}


YARN = {"scaling.type": "yarn", "scaling.factor": 4.0, "scaling.original_context_length": 64}


def refused(read, key: str):
    with pytest.raises(ModelFileError, match=key.replace(".", r"\.")) as info:
        read()
    assert "\n" not in str(info.value)


def test_yarn_without_its_original_context_length_is_refused_naming_the_key():
    refused(lambda: ModelConfig.from_gguf(gguf({**YARN, "scaling.original_context_length": None})),
            "llama.rope.scaling.original_context_length is missing")


@pytest.mark.parametrize("factor", [0.0, math.nan, math.inf, -2.0, "2"])
def test_a_linear_factor_that_is_not_a_finite_number_above_0_is_refused(factor):
    refused(lambda: ModelConfig.from_gguf(gguf({"scaling.type": "linear", "scaling.factor": factor})),
            "llama.rope.scaling.factor is")


@pytest.mark.parametrize("key, value", [
    ("scaling.factor", math.nan), ("scaling.factor", None), ("scaling.original_context_length", 0),
    ("scaling.original_context_length", math.inf), ("scaling.yarn_beta_fast", 0.0),
    ("scaling.yarn_beta_slow", math.nan),
])
def test_every_yarn_key_of_a_gguf_file_is_checked(key, value):
    refused(lambda: ModelConfig.from_gguf(gguf({**YARN, key: value})), "llama.rope." + key)


@pytest.mark.parametrize("freq_base", [0.0, math.nan, -1.0])
def test_a_rope_base_that_is_not_a_finite_number_above_0_is_refused(freq_base):
    refused(lambda: ModelConfig.from_gguf(gguf({"freq_base": freq_base})), "rope_theta")


def test_a_partial_rotary_dimension_count_is_refused():
    with pytest.raises(UnsupportedModelError, match="llama.rope.dimension_count"):
        ModelConfig.from_gguf(gguf({"dimension_count": 8}))


def hf(**rope_scaling) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": rope_scaling}


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope_scaling, key", [
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling.original_max_position_embeddings is missing"),
    ({"rope_type": "linear", "factor": 0}, "rope_scaling.factor is 0"),
    ({"type": "linear", "factor": math.nan}, "rope_scaling.factor is nan"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": math.inf},
     "rope_scaling.attention_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": -1},
     "rope_scaling.mscale"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": "no"},
     "rope_scaling.truncate"),
    ({**LLAMA3, "low_freq_factor": None}, "rope_scaling.low_freq_factor is missing"),
    ({**LLAMA3, "high_freq_factor": 1.0}, "rope_scaling.high_freq_factor"),  # the blend divides by high - low
])
def test_every_rope_scaling_key_of_a_config_json_is_checked(rope_scaling, key):
    refused(lambda: ModelConfig.from_hf(hf(**rope_scaling)), "config.json " + key)


@pytest.mark.parametrize("config", [
    lambda: ModelConfig.from_gguf(gguf(YARN)),
    lambda: ModelConfig.from_gguf(gguf({"scaling.type": "linear", "scaling.factor": 8, "dimension_count": 16})),
    lambda: ModelConfig.from_hf(hf(**LLAMA3)),
    lambda: ModelConfig.from_hf(hf(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                   original_max_position_embeddings=64)),  # gpt-oss's
    lambda: ModelConfig.from_hf(hf(rope_type="linear", factor=8.0)),  # Gemma 3's
])
def test_the_scalings_models_ship_load_and_give_finite_tables(config):
    c = config()
    assert torch.isfinite(rope_cache(c.head_dim, 128, c.rope_theta, c.rope_scaling)).all()


@pytest.mark.parametrize("factors", [torch.zeros(8), torch.full((8,), math.nan), torch.ones(4)])
def test_gguf_rope_frequency_divisors_that_are_not_finite_and_above_0_are_refused(factors):
    with pytest.raises(ModelFileError, match="rope_freqs.weight"):
        rope_cache(16, 32, 10000.0, {"rope_type": "freq_factors", "factors": factors})
