"""Speculative decoding is lossless on the engine: greedy output token for token equal to plain decoding, for every
drafter (model-free, the target's own first layers, a draft model), as chains and as trees, alone and four requests
in one batch; after rejections the cache equals a full recompute."""
import pytest

from fastdecode.engine.kv_cache import BlockTable
from fastdecode.engine.sampling import SamplingParams
from fastdecode.kernels import native_ops
from fastdecode.speculative.model_drafters import DraftModelDrafter, LayerSkipDrafter
from fastdecode.speculative.ngram import NgramDrafter
from fastdecode.speculative.suffix import SuffixDrafter
from tests.helpers.paged import paged, run
from tests.speculative.helpers import (OracleDrafter, plain_tokens, run_requests, speculative_tokens, speculator,
                                       tiny_target)

native = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")
PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 3], [2, 7, 7, 7, 4, 100, 4, 100], list(range(10, 40)), [3] * 12]
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


def draft_model_drafter(model):
    draft_model, draft_runner = tiny_target(seed=3)  # another random model over the same vocabulary
    return DraftModelDrafter("tiny", draft_model, draft_runner.kv, draft_runner, min_confidence=0.0)


def speculator_for(model, runner, name, adaptive):
    """The drafters of `name`: a request's own (model-free) and/or one for every sequence (a model's)."""
    if name == "layerskip":
        return speculator(lambda: [], adaptive, chain=LayerSkipDrafter(model, runner, layers=1, min_confidence=0.0))
    if name == "draft":
        return speculator(lambda: [], adaptive, chain=draft_model_drafter(model))
    make = {"ngram": lambda: [NgramDrafter()], "suffix": lambda: [SuffixDrafter()],
            "auto": lambda: [SuffixDrafter(), NgramDrafter()]}[name]
    return speculator(make, adaptive)


@native
@pytest.mark.parametrize("name", ["ngram", "suffix", "layerskip", "draft", "auto"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_equals_plain_decoding_alone_and_in_a_batch_of_four(name, adaptive):
    model, runner = tiny_target()
    expected = [plain_tokens(model, runner, prompt, GREEDY) for prompt in PROMPTS]
    for prompt, want in zip(PROMPTS, expected):
        got, stats = run_requests(model, runner, [prompt], GREEDY, speculator_for(model, runner, name, adaptive))[0]
        assert got == want, f"{name} diverged on prompt {prompt} alone"
    together = run_requests(model, runner, PROMPTS, GREEDY, speculator_for(model, runner, name, adaptive))
    assert [got for got, _ in together] == expected, f"{name} diverged in a batch of four"
    if not adaptive and name != "auto":
        assert sum(stats.verify_steps for _, stats in together) > 0


@native
@pytest.mark.parametrize("tree", [False, True])
def test_oracle_drafts_with_rejections_stay_lossless(tree):
    model, runner = tiny_target()
    for i, prompt in enumerate(PROMPTS):
        expected = plain_tokens(model, runner, prompt, GREEDY)
        oracle = OracleDrafter(list(prompt) + expected, model.config.vocab_size, tree, seed=i)
        got, stats = speculative_tokens(model, runner, lambda: [oracle], prompt, GREEDY)
        assert got == expected
        assert stats.accepted > 0 and stats.recovered > 0 and stats.bonus > 0


@native
def test_draft_model_cache_follows_the_accepted_tokens():
    """Two requests share the draft model's cache; each gives its blocks back when it ends, the full ones kept
    cached for the next turn's prefix."""
    model, runner = tiny_target()
    drafter = draft_model_drafter(model)
    got, stats = run_requests(model, runner, PROMPTS[:2], GREEDY, speculator(lambda: [], chain=drafter))[1]
    assert stats.drafted > 0 and got == plain_tokens(model, runner, PROMPTS[1], GREEDY)
    assert drafter.kv.available == drafter.kv.capacity // drafter.kv.block_size, \
        "a finished request's draft blocks are not all given back"
    assert drafter.kv.idle, "no full draft block was kept cached"


def test_pytorch_runner_is_lossless_too():
    """The PyTorch runner (float32 weights, PyTorch attention): verify and decode agree to float rounding."""
    model, runner = tiny_target(quant=None, native=False)
    for i, prompt in enumerate(PROMPTS):
        expected = plain_tokens(model, runner, prompt, GREEDY)
        oracle = OracleDrafter(list(prompt) + expected, model.config.vocab_size, tree=True, seed=i)
        got, _ = speculative_tokens(model, runner, lambda: [oracle], prompt, GREEDY)
        assert got == expected
    together = run_requests(model, runner, PROMPTS, GREEDY, speculator_for(model, runner, "layerskip", False))
    assert [got for got, _ in together] == [plain_tokens(model, runner, p, GREEDY) for p in PROMPTS]


@native
@pytest.mark.parametrize("use_native", [True, False])
def test_cache_after_rejections_equals_full_recompute(use_native):
    """The blocks a speculative request leaves cached (its prompt and output, registered as they filled) hold what
    a fresh prefill of the same tokens computes, after its tree's rejected branches were written and moved."""
    model, runner = tiny_target(quant="int4" if use_native else None, native=use_native)
    prompt = list(range(1, 9)) * 4  # a full block of prompt, then output filling the next ones
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    expected = plain_tokens(model, runner, prompt, long)
    oracle = OracleDrafter(list(prompt) + expected, model.config.vocab_size, tree=True, seed=1)
    got, stats = speculative_tokens(model, runner, lambda: [oracle], prompt, long)
    assert got == expected and stats.recovered > 0
    context = list(prompt) + got
    table = BlockTable()
    cached = runner.kv.match_prefix(table, context)
    assert cached >= 96, "the speculative request's output blocks were not registered"
    fresh_runner, fresh_kv = paged(model, "native" if use_native else "pytorch", blocks=8, block_size=32)
    at_once = run(fresh_runner, fresh_kv, [(BlockTable(), 0, context[:cached + 1])])[0][-1]
    from_cache = run(runner, runner.kv, [(table, cached, [context[cached]])])[0][-1]
    assert (at_once - from_cache).abs().max().item() < 1e-4


@native
def test_stop_token_inside_an_accepted_draft_ends_generation():
    model, runner = tiny_target()
    prompt = PROMPTS[1]
    expected = plain_tokens(model, runner, prompt, GREEDY)
    stop = expected[10]
    plain = plain_tokens(model, runner, prompt, GREEDY, stop=[stop])
    oracle = OracleDrafter(list(prompt) + expected, model.config.vocab_size, tree=False)
    got, _ = speculative_tokens(model, runner, lambda: [oracle], prompt, GREEDY, stop=[stop])
    assert got == plain and got[-1] == stop
