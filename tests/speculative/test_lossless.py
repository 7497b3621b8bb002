"""Speculative decoding is lossless: greedy output token for token equal to plain decoding, for every drafter, as
chains and as trees; after rejections the cache equals a full recompute."""
import pytest
import torch

from fastdecode.engine.generate import prefill
from fastdecode.engine.sampling import SamplingParams
from fastdecode.kernels import native_ops
from fastdecode.speculative.model_drafters import DraftModelDrafter, LayerSkipDrafter
from fastdecode.speculative.ngram import NgramDrafter
from fastdecode.speculative.suffix import SuffixDrafter
from tests.speculative.helpers import OracleDrafter, plain_tokens, speculative_tokens, tiny_target

native = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")
PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 3], [2, 7, 7, 7, 4, 100, 4, 100], list(range(10, 40)), [3] * 12]
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


def drafters_for(model, decoder, name):
    return {"ngram": lambda: [NgramDrafter()], "suffix": lambda: [SuffixDrafter()],
            "layerskip": lambda: [LayerSkipDrafter(model, decoder, layers=1, min_confidence=0.0)],
            "auto": lambda: [SuffixDrafter(), NgramDrafter(), LayerSkipDrafter(model, decoder, layers=1)]}[name]()


@native
@pytest.mark.parametrize("name", ["ngram", "suffix", "layerskip", "auto"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_equals_plain_decoding(name, adaptive):
    model, decoder = tiny_target()
    for prompt in PROMPTS:
        expected = plain_tokens(model, decoder, prompt, GREEDY)
        got, stats = speculative_tokens(model, decoder, drafters_for(model, decoder, name), prompt, GREEDY, adaptive)
        assert got == expected, f"{name} diverged on prompt {prompt}"
    if not adaptive and name != "auto":
        assert stats.verify_steps > 0


@native
@pytest.mark.parametrize("tree", [False, True])
def test_oracle_drafts_with_rejections_stay_lossless(tree):
    model, decoder = tiny_target()
    for i, prompt in enumerate(PROMPTS):
        expected = plain_tokens(model, decoder, prompt, GREEDY)
        oracle = OracleDrafter(list(prompt) + expected, model.config.vocab_size, tree, seed=i)
        got, stats = speculative_tokens(model, decoder, [oracle], prompt, GREEDY)
        assert got == expected
        assert stats.accepted > 0 and stats.recovered > 0 and stats.bonus > 0


@native
def test_draft_model_drafter_is_lossless():
    model, decoder = tiny_target()
    draft_model, draft_decoder = tiny_target(seed=3)  # another random model over the same vocabulary
    for prompt in PROMPTS:
        expected = plain_tokens(model, decoder, prompt, GREEDY)
        drafter = DraftModelDrafter("tiny", draft_model, draft_decoder, model.config, min_confidence=0.0)
        got, stats = speculative_tokens(model, decoder, [drafter], prompt, GREEDY)
        assert got == expected
        assert stats.drafted > 0


def test_pytorch_forward_path_is_lossless_too():
    """No native decoder (float32 weights, PyTorch attention): verify and decode agree to float rounding."""
    model, _ = tiny_target(quant=None, native=False)
    for i, prompt in enumerate(PROMPTS):
        expected = plain_tokens(model, None, prompt, GREEDY)
        oracle = OracleDrafter(list(prompt) + expected, model.config.vocab_size, tree=True, seed=i)
        got, _ = speculative_tokens(model, None, [oracle], prompt, GREEDY)
        assert got == expected


@native
@pytest.mark.parametrize("use_native", [True, False])
def test_cache_after_rejections_equals_full_recompute(use_native):
    model, decoder = tiny_target(quant="int4" if use_native else None, native=use_native)
    prompt = PROMPTS[0]
    expected = plain_tokens(model, decoder, prompt, GREEDY)
    oracle = OracleDrafter(list(prompt) + expected, model.config.vocab_size, tree=True, seed=1)
    got, stats = speculative_tokens(model, decoder, [oracle], prompt, GREEDY)
    assert stats.recovered > 0
    context = list(prompt) + got[:-1]
    # The cache holds context[:-1]; decoding the last token from it must match a fresh prefill of all of it.
    pos = len(context) - 1
    step = torch.tensor([[context[-1]]])
    cached = decoder(step, pos) if decoder else model(step, pos)[0, -1]
    recomputed = prefill(model, context)
    assert (cached - recomputed).abs().max().item() < 1e-4


@native
def test_stop_token_inside_an_accepted_draft_ends_generation():
    model, decoder = tiny_target()
    prompt = PROMPTS[1]
    expected = plain_tokens(model, decoder, prompt, GREEDY)
    stop = expected[10]
    plain = plain_tokens(model, decoder, prompt, GREEDY, stop=[stop])
    oracle = OracleDrafter(list(prompt) + expected, model.config.vocab_size, tree=False)
    got, _ = speculative_tokens(model, decoder, [oracle], prompt, GREEDY, stop=[stop])
    assert got == plain and got[-1] == stop
