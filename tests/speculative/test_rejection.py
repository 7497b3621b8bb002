"""Sampling stays lossless: the verifier's output distribution equals the target's, checked statistically, and the
same check fails for a deliberately broken acceptance rule."""
import pytest
import torch

from fastdecode.engine.sampling import Sampler, SamplingParams
from fastdecode.kernels import native_ops
from fastdecode.speculative import verify as verify_module
from fastdecode.speculative.draft import Draft
from fastdecode.speculative.verify import Verdict, verify
from tests.speculative.helpers import OracleDrafter, plain_tokens, speculative_tokens, tiny_target

V = 8
TRIALS = 20000
P_ROOT = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3])  # target logits after the context
P_NEXT = torch.tensor([-1.0, 0.0, 2.0, 0.5, 1.0, 0.0, 0.2, -2.0])  # target logits after the first draft token
Q = torch.softmax(torch.tensor([0.0, 2.0, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0]), -1)  # the drafter's own distribution


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


def run_trials(verify_fn, stochastic: bool):
    """-> (counts of the first emitted token, counts of the second given the first draft token was accepted)."""
    generator = torch.Generator().manual_seed(0)
    first, second = torch.zeros(V), torch.zeros(V)
    logits = torch.stack([P_ROOT, P_NEXT, P_NEXT])
    params = SamplingParams(temperature=1.0)
    for _ in range(TRIALS):
        sampler = Sampler(params, V, [])
        sampler.generator = generator
        if stochastic:
            d = torch.multinomial(torch.stack([Q, Q]), 1, generator=generator).squeeze(1).tolist()
            draft = Draft.chain(d, [0.5, 0.25], q=torch.stack([Q, Q]))
        else:
            draft = Draft.chain([1, 4], [0.5, 0.25])  # deterministic: a one-hot q
        verdict = verify_fn(draft, logits, sampler, set())
        first[verdict.tokens[0]] += 1
        if verdict.path[:1] == [0]:
            second[verdict.tokens[1]] += 1
    return first, second


def always_accept(draft, logits, sampler, stop_ids):
    """A broken rule: keeps every draft token, then draws the bonus token."""
    for t in draft.tokens:
        sampler.accept(t)
    y = sampler.sample(logits[len(draft)])
    return Verdict(list(draft.tokens) + [y], list(range(len(draft))), True)


def accept_without_residual(draft, logits, sampler, stop_ids):
    """A subtler broken rule: accepts with min(1, p/q) but on rejection draws from p instead of max(0, p - q)."""
    p = sampler.probs(logits[0])
    d = draft.tokens[0]
    if torch.rand((), generator=sampler.generator) * draft.q[0][d] < p[d]:
        return Verdict([d, sampler.sample(logits[1])], [0], False)
    return Verdict([int(torch.multinomial(p, 1, generator=sampler.generator))], [], False)


@pytest.mark.parametrize("stochastic", [False, True])
def test_verifier_output_follows_the_target_distribution(stochastic):
    first, second = run_trials(verify, stochastic)
    assert total_variation(first, torch.softmax(P_ROOT, -1)) < 0.02
    assert second.sum() > 1000
    assert total_variation(second, torch.softmax(P_NEXT, -1)) < 0.03


@pytest.mark.parametrize("broken", [always_accept, accept_without_residual])
def test_the_check_fails_for_a_broken_rule(broken):
    first, _ = run_trials(broken, stochastic=True)
    assert total_variation(first, torch.softmax(P_ROOT, -1)) > 0.05


def test_greedy_target_with_a_stochastic_drafter_emits_the_argmax():
    sampler = Sampler(SamplingParams(), V, [])
    draft = Draft.chain([1, 4], [0.5, 0.25], q=torch.stack([Q, Q]))
    verdict = verify_module.verify(draft, torch.stack([P_ROOT, P_NEXT, P_NEXT]), sampler, set())
    assert verdict.tokens == [0]  # draft token 1 is not the argmax (0): rejected, and the recovered token is 0


@pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")
def test_sampled_speculative_decoding_reproduces_plain_sampling_for_a_seed():
    """With a deterministic drafter, verification draws from the same distributions in the same order as plain
    decoding, and the int4 native verify is bit-exact: the same seed gives the same tokens."""
    model, runner = tiny_target()
    prompt = [1, 5, 9, 5, 9, 5, 9, 3]
    for seed in range(5):
        params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=seed,
                                ignore_eos=True)
        expected = plain_tokens(model, runner, prompt, params)
        oracle = OracleDrafter(prompt + expected, model.config.vocab_size, tree=True, seed=seed)
        got, stats = speculative_tokens(model, runner, lambda: [oracle], prompt, params)
        assert got == expected
        assert stats.accepted > 0
