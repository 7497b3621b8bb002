"""Fidelity measures on tiny arrays and a tiny random model."""
import copy

import pytest
import torch
import torch.nn.functional as F

from fastdecode.eval.fidelity import Greedy, Scores, agreement_length, compare, score
from fastdecode.quant import quantize_model
from tests.helpers.tiny import tiny_model


def test_agreement_length_counts_up_to_the_first_difference():
    assert agreement_length([1, 2, 3], [1, 2, 3]) == 3
    assert agreement_length([1, 2, 3], [1, 5, 3]) == 1  # a later match after a difference does not count
    assert agreement_length([4], [5]) == 0
    assert agreement_length([1, 2], [1, 2, 3]) == 2  # the shorter run bounds it


def test_score_is_next_token_nll_and_argmax_per_window():
    model = tiny_model(tied=False)
    windows = torch.randint(0, 128, (3, 10))
    model.setup_cache(10)
    s = score(model, windows)
    with torch.no_grad():
        logits = torch.stack([model(w[None], 0, all_logits=True)[0] for w in windows])  # (3, 10, vocab)
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, 128), windows[:, 1:].reshape(-1), reduction="none")
    assert s.nll.shape == (3, 9) and torch.allclose(s.nll.float(), nll.view(3, 9), atol=1e-5)
    assert torch.equal(s.top1, logits[:, :-1].argmax(-1))
    assert s.perplexity == pytest.approx(torch.exp(nll.mean()).item(), rel=1e-5)


def test_score_grows_a_short_cache():
    model = tiny_model(tied=False)
    model.setup_cache(4)
    assert score(model, torch.randint(0, 128, (1, 12))).nll.shape == (1, 11)


def test_a_model_agrees_with_itself_and_int8_nearly_so():
    model = tiny_model(tied=False)
    windows = torch.randint(0, 128, (2, 24))
    ref = score(model, windows)
    runs = Greedy([[1, 2, 3, 4]], [10.0])
    same = compare(score(copy.deepcopy(model), windows), ref, runs, runs)
    assert same["top1_agreement"] == 1.0 and same["perplexity"] == same["reference_perplexity"]
    assert same["greedy_agreement"] == 1.0 and same["scored_tokens"] == 46
    int8 = compare(score(quantize_model(model, "int8", backend="aten"), windows), ref, runs, runs)
    assert 0.9 <= int8["top1_agreement"] <= 1.0 and int8["perplexity"] == pytest.approx(same["perplexity"], rel=0.02)


def test_compare_fractions():
    ref = Scores(torch.zeros(1, 4, dtype=torch.float64), torch.tensor([[1, 2, 3, 4]]))
    cand = Scores(torch.full((1, 4), 1.0, dtype=torch.float64), torch.tensor([[1, 2, 0, 4]]))
    out = compare(cand, ref, Greedy([[1, 2, 9, 9], [5, 5, 5, 5]], [3.0, 5.0]),
                  Greedy([[1, 2, 3, 4], [5, 5, 5, 5]], [9.0, 9.0]))
    assert out["top1_agreement"] == 0.75 and out["reference_perplexity"] == 1.0
    assert out["perplexity"] == pytest.approx(2.718281828)
    assert out["greedy_agreement_tokens"] == [2, 4] and out["greedy_agreement"] == 6 / 8
    assert out["output_tok_s"] == 4.0  # median over prompts
