import math

import pytest
import torch

from fastdecode.engine.sampling import Sampler, SamplingParams, draw
from fastdecode.errors import InvalidRequestError


def sampler(vocab=8, prompt=(), **kw):
    return Sampler(SamplingParams(**kw), vocab, list(prompt))


def histogram(s: Sampler, logits: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(torch.tensor([s.sample(logits) for _ in range(n)]), minlength=logits.shape[0])


def test_greedy_returns_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sampler(4).sample(logits) == 1


def test_sampling_matches_softmax_distribution():
    # chi-square goodness of fit at 7 degrees of freedom; 24.3 is the 0.001 critical value
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2, -1.0, 1.5])
    n = 20000
    counts = histogram(sampler(temperature=1.0, seed=0), logits, n).float()
    expected = torch.softmax(logits, -1) * n
    assert ((counts - expected) ** 2 / expected).sum() < 24.3


def test_draw_follows_the_weights_and_never_draws_a_zero():
    """The inverse-CDF draw over a vocabulary-sized vector: chi-square against the weights (99 degrees of freedom,
    148.2 is the 0.001 critical value) over the tokens of non-zero weight, which are one in three, and none other."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(300, generator=gen) ** 3
    weights[torch.arange(300) % 3 != 1] = 0
    n = 60000
    counts = torch.bincount(torch.tensor([draw(weights, gen) for _ in range(n)]), minlength=300).double()
    assert counts[weights == 0].sum() == 0
    expected = (weights / weights.sum() * n)[weights > 0].double()
    assert ((counts[weights > 0] - expected) ** 2 / expected).sum() < 148.2
    assert draw(torch.tensor([0.0, 0.0, 2.0]), gen) == 2 and draw(torch.tensor([5.0, 0.0, 0.0]), gen) == 0


@pytest.mark.parametrize("weights", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_draw_refuses_weights_with_nothing_to_draw(weights):
    with pytest.raises(ValueError):
        draw(torch.tensor(weights))


def test_temperature_sharpens_distribution():
    logits = torch.tensor([1.0, 0.0])
    s = sampler(2, temperature=0.5, seed=1)
    assert torch.allclose(s.probs(logits), torch.softmax(logits / 0.5, -1))


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    s1, s2 = sampler(50, temperature=1.0, seed=7), sampler(50, temperature=1.0, seed=7)
    assert [s1.sample(logits) for _ in range(20)] == [s2.sample(logits) for _ in range(20)]


def test_top_k_keeps_only_k_best():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    counts = histogram(sampler(5, temperature=2.0, top_k=2, seed=0), logits, 2000)
    assert counts[2:].sum() == 0 and counts[:2].min() > 0


def test_top_p_keeps_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 keeps the first two (0.5 alone does not reach 0.6)
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    probs = sampler(3, temperature=1.0, top_p=0.6).probs(logits)
    assert probs[2] == 0 and torch.allclose(probs[:2], torch.tensor([0.625, 0.375]))


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    probs = sampler(4, temperature=1.0, min_p=0.2).probs(logits)
    assert probs[2] == 0 and probs[3] == 0 and probs[1] > 0


def test_repetition_penalty_matches_transformers_rule():
    transformers = pytest.importorskip("transformers")
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    s = sampler(4, prompt=[0, 1], repetition_penalty=1.3)
    ref = transformers.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[0, 1]]), logits.clone().unsqueeze(0))[0]
    assert torch.allclose(s.process(logits), ref)


def test_repetition_penalty_covers_prompt_and_output_and_leaves_the_input_alone():
    s = sampler(50, prompt=[3, 3, 7], repetition_penalty=1.5)
    for t in (7, 11, 11, 20):
        s.accept(t)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    seen = torch.zeros(50, dtype=torch.bool)
    seen[[3, 7, 11, 20]] = True
    expected = torch.where(seen, torch.where(before > 0, before / 1.5, before * 1.5), before)
    assert torch.equal(s.process(logits), expected)
    assert torch.equal(logits, before)  # the model's raw logits are still needed (logprobs, the next draft row)


def test_presence_and_frequency_penalties_follow_openai():
    s = sampler(3, presence_penalty=0.5, frequency_penalty=0.25)
    for t in (1, 1, 2):
        s.accept(t)
    out = s.process(torch.zeros(3))
    assert torch.allclose(out, torch.tensor([0.0, -0.5 - 0.5, -0.5 - 0.25]))


def test_penalised_greedy_avoids_repeated_token():
    s = sampler(3, repetition_penalty=10.0)
    s.accept(0)
    assert s.sample(torch.tensor([2.0, 1.0, 0.0])) == 1


@pytest.mark.parametrize("kw", [
    {"temperature": -1}, {"temperature": math.nan}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1},
    {"min_p": 2}, {"max_tokens": 0}, {"repetition_penalty": 0}, {"presence_penalty": 3}, {"stop": [""]},
    {"stop": ["x" * 1025]}, {"stop": ["s"] * 17},
])
def test_invalid_parameters_raise_typed_error(kw):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_greedy_picks_the_first_of_tied_maxima_as_torch_does():
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 2.0])
    assert sampler(5, temperature=0).sample(logits) == int(logits.argmax()) == 1
    assert sampler(5, temperature=0, repetition_penalty=1.2).sample(logits) == 1
    assert sampler(5, temperature=0).sample(logits.double()) == 1  # other dtypes take torch's argmax
