"""ParallelLLM on two gloo ranks, rank 0 driving: greedy output token for token the TP=1 output, with speculation
off and on (the drafters run on rank 0; drafts reach rank 1 as the verify pass's tokens), alone and 4 at once on
the serving engine, where a shared prefix is found in the cache."""
import pytest

from tests.parallel.helpers import MODELS, SPECULATIONS


@pytest.mark.parametrize("name,spec", [(name, spec) for name in MODELS for spec in SPECULATIONS[name]
                                       if not spec.startswith("batch")])
def test_tp2_greedy_tokens_equal_tp1(tiny, name, spec):
    tokens, _ = tiny[name]["tp2"][spec]
    assert tokens == tiny[name]["tp1"]["tokens"]



@pytest.mark.parametrize("spec", ["auto", "oracle", "layerskip"])
def test_speculation_under_tp_verifies_and_accepts_drafts(tiny, spec):
    stats = [tiny[name]["tp2"][spec][1] for name in MODELS if spec in SPECULATIONS[name]]
    assert all(s["verify_steps"] > 0 and s["accepted"] > 0 for s in stats)


@pytest.mark.parametrize("name,spec", [(name, spec) for name in MODELS for spec in SPECULATIONS[name]
                                       if spec.startswith("batch")])
def test_tp2_engine_batch_equals_tp1_alone_and_finds_the_shared_prefix(tiny, name, spec):
    runs = tiny[name]["tp2"][spec]
    assert [tokens for tokens, _ in runs] == tiny[name]["tp1"]["batch"]  # (TP=1: each alone, plain)
    cached = [c for _, c in runs]
    assert cached[0] == 0 and cached[1] == cached[4] == 32  # the first's whole block (kv_cache.BLOCK_SIZE)
    assert cached[2] == cached[3] == 0


def test_the_engine_under_tp_runs_the_native_step_where_it_is_built(tiny):
    from fastdecode.kernels import native_ops

    paths = {tiny[name]["tp2"]["decode_path"] for name in MODELS if "decode_path" in tiny[name]["tp2"]}
    assert paths == {"native" if native_ops() is not None else "pytorch"}
