"""A model sharded over two gloo ranks (loaded shard by shard from safetensors) computes what the whole model
computes: float32 logits within 1e-5 at every prompt position and decode step, the same greedy tokens."""
import pytest
import torch

from fastdecode.config import ModelConfig
from fastdecode.parallel import ShardPlan, shard_model
from tests.helpers.checkpoints import max_diff
from tests.helpers.tiny import tiny_model
from tests.parallel.helpers import MODELS

ATOL = 1e-5  # the same maths; only the order of the all-reduce's sums differs


@pytest.mark.parametrize("name", MODELS)
def test_sharded_prefill_and_decode_logits_match_the_whole_model(tiny, name):
    (prefill1, tokens1, steps1), (prefill2, tokens2, steps2) = tiny[name]["tp1"]["run"], tiny[name]["tp2"]["run"]
    assert max_diff(prefill2, prefill1) <= ATOL
    assert max_diff(steps2, steps1) <= ATOL
    assert tokens2 == tokens1


def test_shard_model_keeps_each_ranks_heads_and_packed_gate_up_rows():
    model = tiny_model(tied=True)  # 4 heads, 2 KV heads of 16, MLP 128, vocab 128
    qkv = model.layers[0].self_attn.qkv_proj.weight.clone()
    gate_up = model.layers[0].mlp.gate_up_proj.weight.clone()
    shard_model(model, ShardPlan.build(model.config, rank=1, world=2))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    # rank 1: query heads 2-3 (rows 32:64), KV head 1 (k rows 64+16:64+32, v rows 96+16:96+32)
    assert torch.equal(attn.qkv_proj.weight, torch.cat([qkv[32:64], qkv[80:96], qkv[112:128]]))
    assert (attn.num_heads, attn.num_kv_heads, attn.split) == (2, 1, (32, 16, 16))
    # gate rows 64:128 then up rows 128+64:256, so chunk(2) still splits gate from up
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate_up[64:128], gate_up[192:256]]))
    assert mlp.down_proj.weight.shape == (64, 64) and attn.o_proj.weight.shape == (64, 32)
    assert model.lm_head.weight is model.embed_tokens.weight and model.embed_tokens.weight.shape == (64, 64)
    assert model.embed_tokens.vocab_start == 64
    assert (model.config.num_key_value_heads, model.config.vocab_size) == (1, 128)  # its cache: 1 KV head


def test_shard_model_gives_the_row_parallel_bias_to_rank_0_only():
    config = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16, attention_bias=True)
    from fastdecode.models.transformer import Transformer

    biases = []
    for rank in (0, 1):
        torch.manual_seed(0)
        model = shard_model(Transformer(config), ShardPlan.build(config, rank, 2))
        biases.append(model.layers[0].self_attn.o_proj.bias)
    assert biases[0].abs().sum() > 0 and torch.equal(biases[1], torch.zeros(32))
