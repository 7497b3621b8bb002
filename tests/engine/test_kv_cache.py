"""The KV cache's block bookkeeping: prefix matching, sharing, idle blocks and least-recently-used eviction."""
import pytest

from fastdecode.engine.kv_cache import BlockTable, KVCache, NoFreeBlocks

BS = 4


def cache(blocks: int = 8) -> KVCache:
    return KVCache(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=blocks, block_size=BS)


def computed(kv: KVCache, tokens: list[int], salt: str = "") -> BlockTable:
    """A sequence that computed `tokens` and let go of its blocks (they stay cached)."""
    table = BlockTable()
    kv.reserve(table, len(tokens))
    kv.commit(table, tokens, len(tokens), salt)
    blocks = list(table.blocks)
    kv.release(table)
    table.blocks = blocks
    return table


def test_a_prefix_is_matched_in_whole_blocks_only():
    kv = cache()
    first = computed(kv, list(range(10)))  # blocks [0-3] [4-7] registered; [8, 9] is not full
    table = BlockTable()
    assert kv.match_prefix(table, list(range(10)) + [99]) == 8
    assert table.blocks == first.blocks[:2]


def test_a_prefix_that_diverges_mid_block_keeps_only_the_blocks_before():
    kv = cache()
    computed(kv, [1, 2, 3, 4, 5, 6, 7, 8])
    table = BlockTable()
    assert kv.match_prefix(table, [1, 2, 3, 4, 5, 6, 0, 8]) == 4


def test_the_limit_leaves_tokens_to_compute():
    kv = cache()
    computed(kv, list(range(8)))
    table = BlockTable()
    # A whole-prompt hit must still run its last token through the model for the next token's logits.
    assert kv.match_prefix(table, list(range(8)), limit=7) == 4


def test_salts_keep_namespaces_apart():
    kv = cache()
    computed(kv, list(range(8)), salt="alice")
    assert kv.match_prefix(BlockTable(), list(range(8)), salt="bob") == 0
    assert kv.match_prefix(BlockTable(), list(range(8)), salt="alice") == 8


def test_shared_blocks_are_referenced_by_each_user_and_idle_only_when_all_let_go():
    kv = cache()
    computed(kv, list(range(8)))
    a, b = BlockTable(), BlockTable()
    kv.match_prefix(a, list(range(8)))
    kv.match_prefix(b, list(range(8)))
    blocks = list(a.blocks)
    assert b.blocks == blocks and all(kv.refs[x] == 2 for x in blocks)
    kv.release(a)
    assert not kv.idle
    kv.release(b)
    assert set(kv.idle) == set(blocks)


def test_idle_blocks_are_evicted_least_recently_used_first():
    kv = cache(blocks=4)
    old = computed(kv, [1] * 4)
    new = computed(kv, [2] * 4)
    kv.match_prefix(BlockTable(), [1] * 4)  # a hit makes `old` the more recent (it is referenced now)
    table = BlockTable()
    kv.reserve(table, 3 * BS)  # 2 free blocks and one eviction: `new`, the only idle one
    assert new.blocks[0] in table.blocks and old.blocks[0] not in table.blocks
    assert kv.match_prefix(BlockTable(), [2] * 4) == 0  # evicted: no longer a hit


def test_reserve_takes_nothing_when_it_cannot_take_everything():
    kv = cache(blocks=2)
    table = BlockTable()
    with pytest.raises(NoFreeBlocks):
        kv.reserve(table, 3 * BS)
    assert table.blocks == [] and kv.available == 2


def test_a_block_with_a_colliding_hash_is_not_shared():
    kv = cache()
    kv._hash = lambda parent, tokens: 7  # every block hashes alike
    computed(kv, [1, 2, 3, 4])
    assert kv.match_prefix(BlockTable(), [5, 6, 7, 8]) == 0  # the tokens differ: no hit


def test_slots_follow_the_block_table():
    kv = cache()
    table = BlockTable(blocks=[5, 2])
    assert kv.slots(table, 2, 6) == [22, 23, 8, 9]


def test_any_salt_hashes_even_one_that_is_not_utf8():
    kv = cache()
    assert kv.prefix_hashes([1, 2, 3, 4], salt="\ud800") != kv.prefix_hashes([1, 2, 3, 4], salt="")
