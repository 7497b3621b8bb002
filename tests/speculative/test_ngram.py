"""Prompt lookup on tiny token arrays."""
from fastdecode.speculative.ngram import NgramDrafter


def test_proposes_what_followed_the_longest_match():
    d = NgramDrafter(max_n=3)
    d.start([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    draft = d.propose([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3], budget=4)
    # "1 2 3" (n=3) occurred at the start, followed by 4 5 9 2.
    assert draft.tokens == [4, 5, 9, 2]


def test_most_recent_occurrence_wins():
    d = NgramDrafter(max_n=2)
    context = [7, 1, 2, 7, 3, 4, 7]
    d.start(context)
    assert d.propose(context, budget=2).tokens == [3, 4]  # "7" last seen before 3 4


def test_no_match_proposes_nothing():
    d = NgramDrafter()
    d.start([1, 2, 3])
    assert d.propose([1, 2, 3], budget=4) is None


def test_never_matches_the_suffix_itself_and_grows_with_the_output():
    d = NgramDrafter(max_n=2)
    context = [5, 6]
    d.start(context)
    assert d.propose(context, 3) is None
    context += [5, 6]
    assert d.propose(context, 3).tokens == [5, 6]  # "5 6" at the start was followed by 5 6


def test_budget_caps_the_draft():
    d = NgramDrafter()
    context = [1, 2, 3, 4, 5, 6, 1]
    assert len(d.propose(context, budget=2)) == 2
