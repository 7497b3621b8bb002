"""Which heads, MLP columns and vocabulary rows each rank holds; what cannot be split."""
import pytest

from fastdecode.config import ModelConfig
from fastdecode.parallel.plan import ShardPlan, SplitError, even_range, head_ranges


def plans(heads: int, kv_heads: int, world: int):
    return [head_ranges(heads, kv_heads, world, rank) for rank in range(world)]


def test_even_split_gives_each_rank_whole_kv_groups():
    # SmolLM2: 9 heads, 3 KV heads (groups of 3) on 3 ranks
    assert plans(9, 3, 3) == [((0, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]


def test_uneven_kv_heads_give_one_rank_a_group_more():
    # 3 KV groups of 2 heads on 2 ranks: 1 group and 2
    assert plans(6, 3, 2) == [((0, 2), (0, 1)), ((2, 6), (1, 3))]


def test_fewer_kv_heads_than_ranks_replicate_the_kv_head():
    # 1 KV head (MQA) on 2 ranks: both hold it; 3 query heads split 1 and 2
    assert plans(3, 1, 2) == [((0, 1), (0, 1)), ((1, 3), (0, 1))]
    # 2 KV heads on 4 ranks: each shared by 2 ranks
    assert plans(8, 2, 4) == [((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]


def test_ranks_that_cannot_share_kv_heads_evenly_are_refused():
    with pytest.raises(SplitError, match="--tp must be a multiple of 3"):
        head_ranges(9, 3, 4, 0)  # SmolLM2 on 4 ranks


def test_more_ranks_than_query_heads_are_refused():
    with pytest.raises(SplitError, match="every rank needs a query head"):
        head_ranges(1, 1, 2, 0)


def test_mixture_of_experts_models_are_refused():
    config = ModelConfig(family="qwen3_moe", vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(SplitError, match="mixture-of-experts"):
        ShardPlan.build(config, 0, 2)


def test_mlp_slices_keep_256_blocks_whole_where_they_can():
    config = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    p0, p1 = (ShardPlan.build(config, r, 2) for r in (0, 1))
    assert (p0.intermediate, p1.intermediate) == ((0, 768), (768, 1536))
    assert (p0.heads, p1.heads, p0.kv_heads, p1.kv_heads) == ((0, 3), (3, 9), (0, 1), (1, 3))
    assert p1.slice_of("layers.0.self_attn.o_proj.weight") == (1, 192, 576)  # columns of heads 3-8
    assert p1.slice_of("layers.0.mlp.down_proj.weight") == (1, 768, 1536)
    assert p1.slice_of("layers.0.input_layernorm.weight") is None  # replicated
    assert p0.vocab_ranges() == [(0, 24576), (24576, 49152)]


def test_even_range_covers_everything_once():
    assert [even_range(161, 2, r) for r in range(2)] == [(0, 80), (80, 161)]
    assert [even_range(96, 2, r, 32) for r in range(2)] == [(0, 32), (32, 96)]
