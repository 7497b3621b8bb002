"""YaRN rope scaling equal to transformers': gpt-oss's tables (truncate false) and transformers' default (true, as
Qwen's YaRN configs use), and a Qwen3 with YaRN matching transformers end to end."""
import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from fastdecode.layers.rotary import rope_cache
from fastdecode.loading import load_model
from tests.helpers.checkpoints import COMMON, max_diff, our_run, prompt_tokens, reference_run, scratch_dir

YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_equal_transformers(truncate):
    config = transformers.GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=64,
                                       rope_parameters={**YARN, "truncate": truncate})
    rotary = GptOssRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1), torch.arange(300)[None])  # (1, 300, 32): one entry per rotary pair
    ours = rope_cache(64, 300, YARN["rope_theta"], config.rope_parameters)
    assert rotary.attention_scaling != 1.0  # the tables carry YaRN's attention factor too
    assert torch.equal(ours[0, :, :32], cos[0]) and torch.equal(ours[1, :, :32], sin[0])
    assert torch.equal(ours[:, :, 32:], ours[:, :, :32])


def test_qwen3_with_yarn_matches_transformers():
    # A short original context, so that most frequencies are scaled within the 40 positions run.
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6}
    config = transformers.Qwen3Config(**{**COMMON, "max_position_embeddings": 64}, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2, rope_parameters=rope)
    torch.manual_seed(0)
    ref_model = transformers.Qwen3ForCausalLM(config).eval()
    path = scratch_dir() / "qwen3_yarn"
    ref_model.save_pretrained(path)
    prompt = prompt_tokens(24)
    ref, ours = reference_run(ref_model, prompt, 16), our_run(load_model(path), prompt, 16)
    assert max_diff(ours.prefill_logits, ref.prefill_logits) <= 1e-4
    assert max_diff(ours.step_logits, ref.step_logits) <= 1e-4
    assert ours.tokens == ref.tokens
