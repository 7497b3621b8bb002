"""SmolLM2-135M (float32, dequantized from its Q4_1 GGUF) on two gloo ranks: greedy tokens equal to TP=1's, with
speculation off and on. The all-reduces sum partial products in another order than one rank's matmul, so equality
holds only while no two top logits are closer than that rounding; these prompts have been checked to stay clear."""
import pytest

from fastdecode.engine.llm import LLM
from fastdecode.engine.sampling import SamplingParams
from tests.helpers.checkpoints import single_thread
from tests.parallel.ranks import WORLD, run_ranks
from tests.parallel.workers import real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):"]  # plain decoding, then n-gram speculation (code repeats)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def runs(smollm2_path):
    with single_thread():
        # TP=1 on the native decode step, in float weights as the TP=2 shards hold them
        one = LLM(str(smollm2_path), quant="none", max_seq_len=256)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        reference = [one.generate(p, params).token_ids for p in PROMPTS]
    return reference, run_ranks(real_model, WORLD, str(smollm2_path), *PROMPTS, MAX_TOKENS)


def test_smollm2_tp2_greedy_tokens_equal_tp1(runs):
    reference, tp2 = runs
    assert tp2["none"] == reference[0]


def test_smollm2_tp2_with_ngram_speculation_equals_tp1(runs):
    reference, tp2 = runs
    assert tp2["ngram"] == reference[1]
    assert tp2["accepted"] > 0  # drafts were verified and kept on both ranks
