"""The tiny models run once, on two ranks, for the shard and LLM tests alike (process start-up is the cost)."""
import pytest

from fastdecode.engine.llm import LLM
from fastdecode.engine.sampling import SamplingParams
from fastdecode.loading import load_model
from tests.helpers.checkpoints import checkpoint, single_thread
from tests.parallel.helpers import BATCH, MODELS, PROMPT, SPECULATIONS, STEPS
from tests.parallel.ranks import WORLD, run_ranks
from tests.parallel.workers import greedy_run, tiny_models

@pytest.fixture(scope="session")
def tiny():
    """{name: {"tp1": {"run": the model's run, "tokens": LLM tokens, "batch": each BATCH prompt's tokens},
    "tp2": {"run": the sharded model's run, spec: (tokens, stats), "batch": [(tokens, cached tokens)]}}}."""
    with single_thread():
        cases, reference = [], {}
        for name in MODELS:
            hf_dir, gguf_path = str(checkpoint(name).hf_dir), str(checkpoint(name).gguf_path)
            one = LLM(gguf_path, max_seq_len=96)  # TP=1 as users run it (native decode where the model fits)
            tokens = one.generate(PROMPT, SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)).token_ids
            reference[name] = {"run": greedy_run(load_model(hf_dir), PROMPT, STEPS), "tokens": tokens}
            if any(spec.startswith("batch") for spec in SPECULATIONS[name]):
                reference[name]["batch"] = [one.generate(p, SamplingParams(max_tokens=STEPS, temperature=0,
                                                                           ignore_eos=True)).token_ids for p in BATCH]
            cases.append((name, hf_dir, gguf_path, SPECULATIONS[name], tokens))
    sharded = run_ranks(tiny_models, WORLD, cases, PROMPT, STEPS, BATCH)
    return {name: {"tp1": reference[name], "tp2": sharded[name]} for name in MODELS}
