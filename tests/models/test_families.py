"""Every family, loaded from safetensors and from GGUF, against transformers on the same weights.

The reference is transformers' own prefill and cached greedy decode; ours must match its float32 logits within
1e-4 at every prompt position and every decode step, and pick the same greedy tokens. On our side alone, cached
decode must equal a full recompute and a prefill in two chunks must equal one prefill.
"""
import dataclasses
import functools

import pytest
import torch

from fastdecode.loading import load_model
from fastdecode.loading.hf_loader import load_hf_dir
from fastdecode.models import model_class
from tests.helpers.checkpoints import (GGUF_SPECS, MOE_SPECS, SPECS, checkpoint, max_diff, our_run, prompt_tokens,
                                       reference_run, single_thread)

PROMPT = prompt_tokens(24)  # longer than every sliding window below
STEPS = 32
ATOL = 1e-4  # ours vs transformers, float32
SELF_ATOL = 1e-5  # ours vs ours: the same maths, batched differently
CASES = [(name, "safetensors") for name in [*SPECS, *MOE_SPECS]] + [(name, "gguf") for name in GGUF_SPECS]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@functools.cache
def reference(name: str):
    return reference_run(checkpoint(name).model, PROMPT, STEPS)


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-{fmt}" for name, fmt in CASES])
def loaded(request):
    """(spec name, our model, our prefill-and-decode run) for one checkpoint in one format."""
    name, fmt = request.param
    ckpt = checkpoint(name)
    model = load_model(ckpt.hf_dir if fmt == "safetensors" else ckpt.gguf_path)
    return name, model, our_run(model, PROMPT, STEPS)


def test_prefill_logits_match_transformers(loaded):
    name, _, ours = loaded
    assert max_diff(ours.prefill_logits, reference(name).prefill_logits) <= ATOL


def test_cached_decode_logits_match_transformers_at_every_step(loaded):
    name, _, ours = loaded
    ref = reference(name)
    agree = next((i for i, (a, b) in enumerate(zip(ours.tokens, ref.tokens)) if a != b), len(ref.tokens))
    # Compare the steps fed the same token; a divergence fails the greedy test below with a clearer message.
    assert max_diff(ours.step_logits[:agree], ref.step_logits[:agree]) <= ATOL


def test_greedy_tokens_match_transformers(loaded):
    name, _, ours = loaded
    assert ours.tokens == reference(name).tokens


def test_cached_decode_equals_full_recompute(loaded):
    _, model, ours = loaded
    sequence = PROMPT + ours.tokens[:-1]  # the last token was predicted, never fed
    model.setup_cache(len(sequence))
    with torch.no_grad():
        full = model(torch.tensor([sequence]), start=0, all_logits=True)[0]
    assert max_diff(full[:len(PROMPT)], ours.prefill_logits) <= SELF_ATOL
    assert max_diff(full[len(PROMPT):], ours.step_logits) <= SELF_ATOL


def test_prefill_in_two_chunks_equals_one_prefill(loaded):
    _, model, _ = loaded
    tokens = torch.tensor([prompt_tokens(30, seed=1)])
    with torch.no_grad():
        model.setup_cache(30)
        one = model(tokens, start=0, all_logits=True)
        model.setup_cache(30)
        first = model(tokens[:, :10], start=0, all_logits=True)
        second = model(tokens[:, 10:], start=10, all_logits=True)
    assert max_diff(torch.cat([first, second], dim=1), one) <= SELF_ATOL


# Each feature the checkpoints carry must move the logits, or the comparisons above could not see it ignored.
FEATURES = [
    ("llama3_rope", {"rope_scaling": None}),
    ("gemma3", {"sliding_window": None}),
    ("mistral_window", {"sliding_window": None}),
    ("gemma3_hf", {"sliding_window": None}),
    ("gemma3_hf", {"query_pre_attn_scalar": None}),
    ("gemma3_hf", {"rope_local_base_freq": 10000.0}),
    ("gemma3_hf", {"final_logit_softcapping": None}),
    ("qwen3_moe", {"norm_topk_prob": False}),
    ("qwen3_moe_hf", {"norm_topk_prob": True}),
]


@pytest.mark.parametrize("name,change", FEATURES, ids=[f"{n}-{next(iter(c))}" for n, c in FEATURES])
def test_each_checkpoint_feature_changes_the_logits(name, change):
    config, weights = load_hf_dir(checkpoint(name).hf_dir)
    config = dataclasses.replace(config, **change)
    model = model_class(config.family)(config)
    model.load_weights(weights)
    model.setup_cache(len(PROMPT))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT]), start=0, all_logits=True)[0]
    assert max_diff(logits, reference(name).prefill_logits) > 100 * ATOL
