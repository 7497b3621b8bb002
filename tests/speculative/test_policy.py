"""The adaptive policy: the cost model, calibration of drafter scores, and falling back to plain decoding."""
import pytest

from fastdecode.engine.sampling import SamplingParams
from fastdecode.kernels import native_ops
from fastdecode.speculative.draft import Draft
from fastdecode.speculative.policy import MARGIN, PROBE_GAP, PROBE_NODES, CostModel, Policy
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

    def propose(self, context, budget):
        return Draft.chain([(context[-1] + 1 + i) % 128 for i in range(min(budget, 4))], [0.95] * min(budget, 4),
                           drafter=self.name)


@pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")
def test_adaptive_policy_stops_verifying_a_drafter_that_is_always_wrong():
    model, decoder = tiny_target()
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    prompt = [1, 2, 3, 4]
    got, stats = speculative_tokens(model, decoder, [WrongDrafter()], prompt, params, adaptive=True,
                                    cost=FixedCost(*vars(linear_cost()).values()))
    assert got == plain_tokens(model, decoder, prompt, params)
    assert stats.verify_steps < 0.2 * stats.steps  # a few tries, then plain decode steps


def test_probes_are_spaced_out_even_when_many_score_bins_are_untested():
    """Drafts whose first nodes fall in ten different untested bins, two drafters: without spacing every one of them
    would be probed at once, a burst of failed verify steps in one stretch of output."""
    policy = Policy(linear_cost())
    probes = []
    for i in range(10 * PROBE_GAP):
        drafter = "ab"[i % 2]
        score = (i // 2 % 10 + 0.5) / 10
        chosen, _ = policy.choose(Draft.chain([1, 2], [score, score * score], drafter=drafter))
        if chosen is not None:
            probes.append(i)
            policy.learn(chosen, [])
    assert len(probes) >= 5  # the bins are still explored
    assert all(b - a >= PROBE_GAP for a, b in zip(probes, probes[1:]))
