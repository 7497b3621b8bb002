"""Suffix tries and the suffix drafter on tiny token arrays."""
import random

import pytest

from fastdecode.speculative.suffix import (PROMPT_TAIL, SuffixDrafter, SuffixMemory, SuffixTrie, TextIndex, first_scores,
                                          grow_tree)


def test_trie_counts_every_suffix_up_to_its_depth():
    trie = SuffixTrie(depth=3)
    trie.insert([1, 2, 1, 2])
    assert trie.root.children[1].count == 2
    assert trie.root.children[1].children[2].count == 2
    assert trie.root.children[2].children[1].children[2].count == 1
    assert max_depth(trie.root) == 3


def max_depth(node) -> int:
    return 1 + max((max_depth(c) for c in node.children.values()), default=0) if node.children else 0


def test_remove_undoes_insert():
    trie = SuffixTrie(depth=4)
    trie.insert([1, 2, 3])
    trie.insert([2, 3, 4, 5])
    trie.remove([1, 2, 3])
    reference = SuffixTrie(depth=4)
    reference.insert([2, 3, 4, 5])
    assert as_dict(trie.root) == as_dict(reference.root)


def as_dict(node):
    return {t: (c.count, as_dict(c)) for t, c in node.children.items()}


def test_match_finds_the_longest_suffix_with_a_continuation():
    trie = SuffixTrie(depth=8)
    trie.insert([9, 1, 2, 3, 4])
    length, node = trie.match([7, 1, 2, 3], max_len=8)
    assert length == 3 and list(node.children) == [4]


@pytest.mark.parametrize("seed", range(20))
def test_match_is_the_longest_stored_suffix_with_a_continuation(seed):
    """Against the definition, over requests remembered and evicted: the longest suffix of the context (at most
    max_len and depth - 1 tokens) that some stored request holds with a token after it."""
    rng = random.Random(seed)
    memory = SuffixMemory(depth=rng.choice([3, 6, 24]), max_tokens=rng.choice([20, 200]))
    for _ in range(rng.randrange(1, 8)):
        memory.remember([rng.randrange(4) for _ in range(rng.randrange(1, 30))])
    stored = list(memory.sequences.values())
    for _ in range(20):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
        max_len = rng.choice([1, 4, 16])
        expected = 0
        for m in range(min(max_len, len(context), memory.trie.depth - 1), 0, -1):
            pattern = context[-m:]
            if any(s[i:i + m] == pattern for s in stored for i in range(len(s) - m)):
                expected = m
                break
        m, node = memory.trie.match(context, max_len)
        assert m == expected and (node is None) == (expected == 0)


def test_draft_tree_branches_by_frequency():
    d = SuffixDrafter(depth_per_match=2)
    # After "1 2", 3 followed twice and 4 once: both branches, 3 first and likelier.
    context = [1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 1, 2]
    d.start(context)
    draft = d.propose(context, budget=8)
    first_level = {t: s for t, s, p in zip(draft.tokens, draft.scores, draft.parents) if p == -1}
    assert set(first_level) == {3, 4}
    assert first_level[3] > first_level[4]
    assert abs(first_level[3] - 2 / 3 * 2 / 3) < 1e-9  # frequency 2/3, times 2/3 for a two-token match


def test_a_longer_match_scores_its_continuations_higher():
    """Both continuations were seen once, after a one-token and after a four-token match: the scores tell them apart
    (the policy calibrates per score bin), and along a draft each step's score grows with the tokens matched."""
    d = SuffixDrafter(depth_per_match=2)
    short = [5, 9, 8, 5]  # "5" was followed by 9 once
    d.start(short)
    one = d.propose(short, budget=4)
    long = [1, 2, 3, 4, 7, 7, 7, 1, 2, 3, 4]  # "1 2 3 4" was followed by 7 7 7 once
    d.start(long)
    four = d.propose(long, budget=4)
    assert one.scores[0] == 0.5 and four.scores[0] == 0.8
    steps = [four.scores[i] / four.scores[four.parents[i]] for i in range(1, len(four)) if four.parents[i] >= 0]
    assert steps == pytest.approx([5 / 6, 6 / 7, 7 / 8])


def test_depth_scales_with_match_length():
    d = SuffixDrafter(depth_per_match=1)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    d.start(context)
    assert max(d.propose(context, budget=16).depths()) == 1  # a one-token match drafts one token deep


def test_earlier_requests_are_remembered_and_evicted_oldest_first():
    d = SuffixDrafter(global_tokens=12)
    d.start([1, 2, 3, 4, 5, 6])
    d.finish([1, 2, 3, 4, 5, 6])
    d.start([20, 1, 2])
    assert d.propose([20, 1, 2], budget=3).tokens == [3, 4, 5]  # learned from the earlier request
    d.finish([20, 1, 2])
    d.finish(list(range(30, 40)))  # 19 tokens stored > 12: the oldest request goes
    d.start([1, 2])
    assert d.propose([1, 2], budget=3) is None


@pytest.mark.parametrize("seed", range(40))
def test_text_index_matches_and_drafts_as_a_trie_over_the_same_text(seed):
    """The request's own text is indexed by positions rather than built into a trie: every match and every draft
    grown from it (tokens, parents, scores, order) must be the trie's, including where the trie's depth cuts it."""
    rng = random.Random(seed)
    depth = rng.choice([3, 5, 24])
    text = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(1, 80))]
    trie, index = SuffixTrie(depth), TextIndex(depth)
    trie.insert(text)
    index.extend(text)
    for max_len in (1, 2, 4, 16):
        m, node = trie.match(text, max_len)
        m2, occ = index.match(text, max_len)
        assert m2 == m and (occ is None) == (node is None)
        if node is None:
            continue
        assert sorted(first_scores(occ, m)) == sorted(first_scores(node, m))
        for budget, max_depth in ((1, 1), (8, 2), (24, 48)):
            a = grow_tree(node, m, budget, max_depth, 0.01, "suffix")
            b = grow_tree(occ, m, budget, max_depth, 0.01, "suffix")
            assert (b.tokens, b.parents, b.scores) == (a.tokens, a.parents, a.scores)


def test_a_finished_request_leaves_its_output_and_the_prompt_tail_before_it():
    """A long prompt is not inserted (a later request has its own prompt in its own index): the memory holds the
    output and the PROMPT_TAIL prompt tokens that lead into it, so a request ending the same way drafts the output."""
    d = SuffixDrafter()
    prompt = list(range(1000, 1300))
    output = [5, 6, 7, 8]
    d.start(prompt)
    d.finish(prompt + output)
    assert d.memory.stored == PROMPT_TAIL + len(output)
    d.start([1, 2] + prompt[-3:])
    assert d.propose([1, 2] + prompt[-3:], budget=4).tokens == output
    early = prompt[:10]  # the prompt's start is not remembered
    d.start([1, 2] + early)
    assert d.propose([1, 2] + early, budget=4) is None


def test_drafters_remember_earlier_requests_only_within_their_tenant():
    from types import SimpleNamespace

    from fastdecode.speculative.batch import BatchSpeculator
    from fastdecode.speculative.policy import CostModel

    spec = BatchSpeculator.build("suffix", CostModel([1, 64], [1.0, 1.0]))
    secret = [7, 8, 9, 1, 2, 3, 4, 5, 6]

    def request(tenant, tokens):
        seq = SimpleNamespace(tenant=tenant, prompt_ids=tokens, params=None, tokens=list(tokens))
        spec.start(seq)
        return seq

    spec.finish(request("alice", secret))
    for tenant, remembers in (("alice", True), ("bob", False), (None, False)):
        drafter = request(tenant, [7, 8, 9]).speculation.drafters[0]
        draft = drafter.propose([7, 8, 9], budget=4)
        assert (draft is not None and draft.tokens[:3] == [1, 2, 3]) == remembers, tenant
    spec.finish(request(None, secret))  # a request without a tenant leaves nothing behind, for anyone
    for tenant in (None, "bob"):
        assert request(tenant, [7, 8, 9]).speculation.drafters[0].propose([7, 8, 9], budget=4) is None, tenant
