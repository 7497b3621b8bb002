"""The adaptive policy: the cost model, calibration of drafter scores, and falling back to plain decoding."""
import random

import pytest

from fastdecode.engine.sampling import SamplingParams
from fastdecode.kernels import native_ops
from fastdecode.speculative.draft import Draft
from fastdecode.speculative.policy import MARGIN, PROBE_GAP, PROBE_NODES, PROBE_SPEND, CostModel, Policy
from tests.speculative.helpers import plain_tokens, speculative_tokens, tiny_target
from fastdecode.speculative.drafter import Drafter


def linear_cost() -> CostModel:
    return CostModel([1, 2, 4, 8], [1.0, 1.5, 2.5, 4.5])  # each extra token costs half a decode step


class FixedCost(CostModel):
    """Ignores the step timings: on a tiny model an extra verified token is free, which would hide the policy."""

    def observe(self, tokens: int, seconds: float, weight: float = 0.1):
        pass


def test_cost_model_interpolates_and_follows_observations():
    cost = linear_cost()
    assert cost(3) == pytest.approx(2.0)
    assert cost(16) == pytest.approx(8.5)  # extrapolated along the last segment
    for _ in range(100):
        cost.observe(1, 2.0)  # the machine got twice as slow for plain steps
    assert cost(1) == pytest.approx(2.0, rel=0.01)
    assert cost(2) >= cost(1)  # stays monotone


def test_observations_keep_the_costs_in_order_and_move_the_nearest_size():
    rng = random.Random(0)
    cost = CostModel([1, 2, 4, 8, 16], [1.0, 1.2, 1.6, 2.4, 4.0])
    for _ in range(500):
        tokens, before = rng.randrange(1, 24), list(cost.seconds)
        version = cost.version
        cost.observe(tokens, rng.uniform(0.2, 8.0))
        assert cost.seconds == sorted(cost.seconds) and cost.version == version + 1
        nearest = min(range(5), key=lambda j: abs(cost.sizes[j] - tokens))
        assert all(a == b for j, (a, b) in enumerate(zip(before, cost.seconds)) if j < nearest)  # smaller sizes stay


def test_confident_drafts_are_verified_and_poor_ones_are_not():
    policy = Policy(linear_cost())
    chain = Draft.chain([1, 2, 3, 4], [0.99, 0.98, 0.97, 0.96], drafter="d")
    for _ in range(200):  # the drafter's confident drafts were always accepted
        policy.learn(chain, [0, 1, 2, 3])
    chosen, rate = policy.choose(chain)
    assert len(chosen) == 4 and rate > 1.0
    for _ in range(2000):  # now they never are
        policy.learn(chain, [])
    chosen, rate = policy.choose(chain)
    assert chosen is None and rate == pytest.approx(1.0)


@pytest.mark.parametrize("accept_rate, verified", [(0.6, False), (0.8, True)])
def test_a_draft_must_beat_plain_decoding_by_the_margin(accept_rate, verified):
    """A one-node draft costs 1.5 steps here, so it pays from an acceptance of 0.5 on; within the margin (0.6 promises
    1.07x plain) it is left alone, above it (0.8: 1.2x) verified."""
    assert MARGIN == pytest.approx(0.1)
    policy = Policy(linear_cost())
    node = Draft.chain([7], [0.99], drafter="d")
    for i in range(500):
        policy.learn(node, [0] if i % 10 < 10 * accept_rate else [])
    chosen, rate = policy.choose(node)
    assert (chosen is not None) == verified
    assert rate == pytest.approx((1 + accept_rate) / 1.5, abs=0.03) if verified else rate == pytest.approx(1.0)
    trained_without_margin = Policy(linear_cost(), margin=0.0)
    trained_without_margin.calibration = policy.calibration
    assert trained_without_margin.choose(node)[0] is not None  # both gain over plain decoding, by 7% and by 20%


def test_only_nodes_whose_parent_was_accepted_count_as_tries():
    policy = Policy(linear_cost())
    chain = Draft.chain([1, 2, 3, 4], [1.0, 1.0, 1.0, 1.0], drafter="d")
    policy.learn(chain, [0])  # node 1 was rejected; nodes 2 and 3 were never put to the test
    cal = policy.calibration["d"]
    assert sum(cal.tries) == pytest.approx(2, abs=0.01) and sum(cal.hits) == pytest.approx(1, abs=0.01)


def test_a_path_is_as_likely_as_the_product_of_its_steps():
    policy = Policy(linear_cost())
    chain = Draft.chain([1, 2, 3], [0.95, 0.95 * 0.5, 0.95 * 0.25], drafter="d")  # steps of 0.95, 0.5, 0.5
    for _ in range(300):
        policy.learn(chain, [0])  # steps scored 0.95 always accepted, steps scored 0.5 never
    est = policy.estimates(chain)
    assert est[0] > 0.9 and est[1] < 0.1 and est[2] <= est[1]


def test_a_drafter_that_went_bad_is_tried_again_after_a_while():
    policy = Policy(CostModel([1, 2, 4, 8], [1.0, 1.25, 1.75, 2.75]))  # each extra token a quarter of a step
    chain = Draft.chain([1, 2, 3, 4], [0.99] * 4, drafter="d")
    for _ in range(20):
        policy.learn(chain, [])
    assert policy.choose(chain)[0] is None
    consultations = 1
    while policy.choose(chain)[0] is None:  # every consultation forgets a little of the bad evidence
        consultations += 1
        assert consultations < 1000
    assert consultations > 20  # but not at once


def test_a_confident_draft_without_evidence_is_probed_and_then_verified_in_full():
    """Untested scores start pessimistic (a long chain of them promises less than its cost), so without a probe a
    fresh process would never verify a draft and never learn that its drafts are good."""
    policy = Policy(linear_cost())
    chain = Draft.chain(list(range(12)), [1.0] * 12, drafter="d")
    assert policy.estimates(chain)[0] == pytest.approx(0.5)
    probe, _ = policy.choose(chain)
    assert probe is not None and len(probe) == PROBE_NODES
    for _ in range(40):  # each verified draft was accepted whole
        policy.learn(probe, list(range(len(probe))))
        probe, _ = policy.choose(chain)
        if len(probe) == 12:
            break
    assert len(probe) == 12


def test_a_drafter_that_fails_its_probe_is_probed_again_only_after_a_while():
    policy = Policy(linear_cost())
    chain = Draft.chain([1, 2, 3, 4], [0.9] * 4, drafter="d")
    verified = []
    for _ in range(300):
        chosen, _ = policy.choose(chain)
        verified.append(chosen is not None)
        if chosen is not None:
            policy.learn(chain, [])  # the first node is always rejected
    assert verified[0] and 2 <= sum(verified) <= 300 / 50


def test_tree_nodes_are_chosen_parents_first():
    policy = Policy(CostModel([1, 64], [1.0, 1.0]))
    d = Draft(drafter="t")
    a = d.add(1, -1, 0.9)
    d.add(2, a, 0.8)
    d.add(3, -1, 0.05)
    chosen, _ = policy.choose(d)
    assert chosen.tokens[:2] == [1, 2] and chosen.parents[:2] == [-1, 0]


class WrongDrafter(Drafter):
    """Always confident, always wrong: the adversary that makes naive speculation slower than plain decoding."""
    name = "wrong"

    def propose(self, context, budget, promising=None):
        return Draft.chain([(context[-1] + 1 + i) % 128 for i in range(min(budget, 4))], [0.95] * min(budget, 4),
                           drafter=self.name)


@pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")
def test_adaptive_policy_stops_verifying_a_drafter_that_is_always_wrong():
    model, runner = tiny_target()
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    prompt = [1, 2, 3, 4]
    got, stats = speculative_tokens(model, runner, lambda: [WrongDrafter()], prompt, params, adaptive=True,
                                    cost=FixedCost(*vars(linear_cost()).values()))
    assert got == plain_tokens(model, runner, prompt, params)
    assert stats.verify_steps < 0.2 * stats.steps  # a few tries, then plain decode steps


@pytest.mark.parametrize("cost, bins, gap", [
    # Memory-bound: a probe's row costs 5% of a step. Scores up to 0.2 only, which promise too little to be verified.
    (CostModel([1, 2, 4, 8], [1.0, 1.05, 1.15, 1.35]), 2, PROBE_GAP),
    (linear_cost(), 10, 0.5 / PROBE_SPEND),  # compute-bound: half a step, so probes are spaced by their price
])
def test_probes_are_spaced_out_even_when_many_score_bins_are_untested(cost, bins, gap):
    """Drafts whose first nodes fall in different untested bins, two drafters: without spacing every one of them
    would be probed at once, a burst of failed verify steps in one stretch of output."""
    policy = Policy(cost)
    probes = []
    for i in range(int(10 * gap)):
        drafter = "ab"[i % 2]
        score = (i // 2 % bins + 0.5) / 10
        chosen, _ = policy.choose(Draft.chain([1, 2], [score, score * score], drafter=drafter))
        if chosen is not None:
            probes.append(i)
            policy.learn(chosen, [])
    assert len(probes) >= 5  # the bins are still explored
    assert all(b - a >= gap for a, b in zip(probes, probes[1:]))
    assert min(b - a for a, b in zip(probes, probes[1:])) < 2 * gap


def random_draft(rng: random.Random, drafter: str) -> Draft:
    d = Draft(drafter=drafter)
    for i in range(rng.randrange(1, 12)):
        parent = rng.randrange(-1, i) if rng.random() < 0.5 else i - 1
        base = d.scores[parent] if parent >= 0 else 1.0
        d.add(rng.randrange(100), parent, base * rng.random() ** (1.0 if parent < 0 else 0.3))
    return d


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("seconds", [[1.0, 1.02, 1.06, 1.14, 1.3], [1.0, 1.3, 1.32, 1.82, 2.8], [1.0, 1.5, 2.5, 4.5, 8.5]])
def test_the_gate_turns_away_only_drafts_that_choose_would_not_verify(seed, seconds):
    """A drafter builds no draft when none of its first nodes passes the gate. Two policies in lockstep, one gated
    and one not, over memory-bound to compute-bound costs and random drafts, base rows and outcomes, must verify the
    same nodes at every step: the gate is a bound, not a second opinion."""
    rng = random.Random(seed)
    gated, plain = Policy(CostModel([1, 2, 4, 8, 16], seconds)), Policy(CostModel([1, 2, 4, 8, 16], list(seconds)))
    turned_away = 0
    for step in range(600):
        drafter = rng.choice("ab")
        draft = random_draft(rng, drafter)
        rows = rng.choice([0, 0, 0, 1, 3])
        tokens = rows * rng.choice([1.0, 1.5])
        promising = gated.gate(drafter, rows, tokens)
        first = [s for s, p in zip(draft.scores, draft.parents) if p < 0]
        if any(promising(s) for s in first):
            chosen, _ = gated.choose(draft, base_rows=rows, base_tokens=tokens, gated=True)
        else:
            chosen, turned_away = None, turned_away + 1
        expected, _ = plain.choose(draft, base_rows=rows, base_tokens=tokens)
        assert (chosen.tokens if chosen else None) == (expected.tokens if expected else None), step
        if chosen is not None:
            path, node = [], -1  # accepted: a random walk down the chosen nodes
            while rng.random() < 0.4:
                children = [i for i, p in enumerate(chosen.parents) if p == node]
                if not children:
                    break
                node = rng.choice(children)
                path.append(node)
            gated.learn(chosen, path)
            plain.learn(chosen, path)
    assert turned_away > 0  # the bound was put to the test
