"""On SmolLM2-135M (int4, native decode): 20 coding-agent prompts x 128 tokens, greedy output of every drafter
token for token equal to plain decoding; the API and CLI report speculation stats."""
import json

import pytest

from fastdecode.engine.llm import LLM
from fastdecode.engine.sampling import SamplingParams
from fastdecode.kernels import native_ops
from fastdecode.workloads import CATEGORIES, load_workload

pytestmark = pytest.mark.skipif(native_ops() is None, reason="native kernels unavailable")
PARAMS = SamplingParams(max_tokens=128, ignore_eos=True)


@pytest.fixture(scope="module")
def llms(smollm2_path):
    """One LLM per --speculate value, built on first use; every one serves on the engine. "draft:self": the target
    drafting for itself as a draft model (its own weights, its own cache)."""
    made = {}

    def get(spec: str):
        if spec not in made:
            value = f"draft:{smollm2_path}" if spec == "draft:self" else spec
            made[spec] = LLM(str(smollm2_path), quant="int4", threads=2, speculate=value)
        return made[spec]
    yield get
    for llm in made.values():
        llm.close()


@pytest.fixture(scope="module")
def prompts(llms):
    items = [item for c in CATEGORIES for item in load_workload(c)[:4]]
    return [llms("none").chat_prompt(item.messages) for item in items]


@pytest.fixture(scope="module")
def plain(llms, prompts):
    """Plain greedy tokens, each prompt alone."""
    return [llms("none").generate(p, PARAMS).token_ids for p in prompts]


@pytest.mark.parametrize("spec,forced,count", [(s, False, 20) for s in ("ngram", "suffix", "layerskip", "auto")]
                         + [("draft:self", False, 5), ("ngram", True, 5), ("suffix", True, 5)])
def test_every_drafter_reproduces_plain_greedy_decoding(llms, prompts, plain, spec, forced, count):
    """As shipped (adaptive) on all 20 prompts (a draft model on 5); forced (every draft of up to 8 nodes verified
    in full, the most rejections and cache moves) on 5, as a chain (ngram) and as a tree (suffix)."""
    llm = llms(spec)
    policy = llm.engine.speculator.policy
    saved = policy.adaptive, policy.max_nodes
    if forced:
        policy.adaptive, policy.max_nodes = False, 8
    accepted = verified = 0
    try:
        for i, (prompt, expected) in enumerate(zip(prompts[:count], plain)):
            completion = llm.generate(prompt, PARAMS)
            assert completion.token_ids == expected, f"{spec} diverged on prompt {i}"
            accepted += completion.speculation["accepted"]
            verified += completion.speculation["verify_steps"]
    finally:
        policy.adaptive, policy.max_nodes = saved
    assert verified > 0, "no draft was ever verified: the comparison proved nothing"
    assert accepted > 0 or spec == "layerskip"  # an untrained early exit may never pay on its own


def test_stats_are_reported(llms, prompts):
    stats = llms("ngram").generate(prompts[0], PARAMS).speculation
    for key in ("drafter", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "draft_s", "verify_s"):
        assert key in stats
    assert 0 <= stats["acceptance_rate"] <= 1


def test_cli_json_carries_a_speculation_object(smollm2_path):
    from click.testing import CliRunner

    from fastdecode.cli import main

    result = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "--quant", "int4", "--threads", "2",
                                       "--speculate", "suffix", "--max-tokens", "24", "--json",
                                       "-p", "a b c a b c a b c a b c"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["speculation"]["drafter"] == "suffix"
    assert {"drafted", "accepted", "acceptance_rate", "mean_accepted_length"} <= set(out["speculation"])


def test_unknown_speculate_value_is_one_clear_line(smollm2_path):
    from click.testing import CliRunner

    from fastdecode.cli import main

    result = CliRunner().invoke(main, ["generate", "-m", str(smollm2_path), "--speculate", "magic", "-p", "x"])
    assert result.exit_code == 2
    assert "--speculate must be one of" in result.output
