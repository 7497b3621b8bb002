"""The serving engine over the paged KV cache: both runners against transformers for every family, prefix hits
against full recomputes, and a randomized run (arrivals, cancellations, prefix hits, preemption, speculation)
whose every output equals the same request run alone."""
import random
import time

import pytest
import torch

from fastdecode.engine.engine import Engine
from fastdecode.engine.kv_cache import BlockTable, KVCache
from fastdecode.engine.sampling import SamplingParams
from fastdecode.config import ModelConfig
from fastdecode.engine.scheduler import SchedulerConfig, fair_shares, prefill_floor
from fastdecode.errors import InvalidRequestError
from fastdecode.loading import load_model
from fastdecode.runners.native import NativeRunner
from fastdecode.speculative.batch import BatchSpeculator
from fastdecode.speculative.ngram import NgramDrafter
from fastdecode.speculative.policy import Policy
from fastdecode.speculative.suffix import SuffixDrafter
from tests.helpers.paged import RUNNERS, paged, run
from tests.helpers.checkpoints import (MOE_SPECS, SPECS, checkpoint, max_diff, prompt_tokens, reference_run,
                                       single_thread)
from tests.speculative.helpers import OracleDrafter, flat_cost, tiny_target

PROMPT = prompt_tokens(24)  # longer than every sliding window of the family checkpoints
ATOL = 1e-4  # ours vs transformers, float32
KV16_ATOL = 5e-3  # ours with a float16 KV cache vs transformers in float32: keys and values rounded once
SELF_ATOL = 1e-5  # ours vs ours: the same maths, batched differently


def self_atol(kv_dtype) -> float:
    """Float weights go through a library GEMM in both runners (at::linear in the native step too), which may round
    a row differently by the rows beside it (on AVX2 it did, for the MoE experts' row subsets); a key an ulp off
    before rounding can then land on the neighbouring float16 value. Quantized weights' rows are the same arithmetic
    in any batch: the int4 engine tests below (tiny_engine) compare them bit for bit."""
    return SELF_ATOL if kv_dtype == torch.float32 else 1e-3
KV_DTYPES = [torch.float32, torch.float16]
# Every family, mixture-of-experts ones included, on both runners.
CASES = [(name, runner) for name in [*SPECS, *MOE_SPECS] for runner in RUNNERS]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("name,runner", CASES)
def test_paged_prefill_and_decode_match_transformers(name, runner, kv_dtype):
    r, kv = paged(load_model(checkpoint(name).hf_dir), runner, dtype=kv_dtype)
    ref = reference_run(checkpoint(name).model, PROMPT, 8)
    atol = ATOL if kv_dtype == torch.float32 else KV16_ATOL
    table = BlockTable()
    (prefill,) = run(r, kv, [(table, 0, PROMPT)])
    assert max_diff(prefill, ref.prefill_logits) <= atol
    for i, token in enumerate(ref.tokens[:-1]):  # decode steps fed transformers' own greedy tokens
        (step,) = run(r, kv, [(table, len(PROMPT) + i, [token])])
        assert max_diff(step[0], ref.step_logits[i]) <= atol


@pytest.mark.parametrize("name", SPECS)
def test_float16_cache_native_and_pytorch_runners_agree(name):
    """Both runners round a key or value to float16 once, when written, and widen it when read."""
    model = load_model(checkpoint(name).hf_dir)
    logits = []
    for runner in RUNNERS:
        r, kv = paged(model, runner, dtype=torch.float16)
        table = BlockTable()
        out = run(r, kv, [(table, 0, PROMPT)])[0]
        step = run(r, kv, [(table, len(PROMPT), [int(out[-1].argmax())])])[0]
        assert kv.k[0].dtype == torch.float16
        logits.append(torch.cat([out, step]))
    # Values a float32 ulp apart before rounding may land on neighbouring float16 values (2^-11 relative).
    assert max_diff(*logits) <= 1e-3


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("name,runner", CASES)
@pytest.mark.parametrize("cached", [13, 16])  # a first request that ends mid-block and one that ends on a boundary
def test_logits_after_a_prefix_hit_equal_a_full_recompute(name, runner, cached, kv_dtype):
    r, kv = paged(load_model(checkpoint(name).hf_dir), runner, dtype=kv_dtype)
    (whole,) = run(r, kv, [(BlockTable(), 0, PROMPT)])
    first = BlockTable()
    run(r, kv, [(first, 0, PROMPT[:cached])])
    kv.commit(first, PROMPT, cached)
    second = BlockTable()
    hit = kv.match_prefix(second, PROMPT, limit=len(PROMPT) - 1)
    assert hit == cached - cached % kv.block_size and second.blocks[:hit // 8] == first.blocks[:hit // 8]
    (rest,) = run(r, kv, [(second, hit, PROMPT[hit:])])
    assert max_diff(rest, whole[hit:]) <= self_atol(kv_dtype)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_sequences_in_one_batch_get_their_solo_logits(runner, kv_dtype):
    name = "gemma3"  # sliding windows and a full layer
    r, kv = paged(load_model(checkpoint(name).hf_dir), runner, blocks=32, dtype=kv_dtype)
    prompts = [PROMPT, prompt_tokens(9, seed=2), prompt_tokens(17, seed=3)]
    solo = [run(r, kv, [(BlockTable(), 0, p)])[0] for p in prompts]
    together = run(r, kv, [(BlockTable(), 0, p) for p in prompts])
    for a, b in zip(solo, together):
        assert max_diff(a, b) <= self_atol(kv_dtype)


def test_a_long_sequence_decodes_alike_alone_and_beside_others():
    """Alone, a decode step of a sequence with few KV heads spreads its chunks of 256 keys over the threads and the
    last to finish folds their partials; beside other sequences, each KV group's chunks fold in one work item. The
    logits must be equal bit for bit: the same partials fold in the same order. (int8 weights: activations stay
    float, so an attention output an ulp off would show.)"""
    model, _ = tiny_target("int8", max_seq_len=8)
    r, kv = paged(model, "native", blocks=96, dtype=torch.float16, positions=512)
    prompts = [tiny_prompt(300, 7), tiny_prompt(200, 8), tiny_prompt(150, 9)]
    tables = [BlockTable() for _ in prompts]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 2 KV heads of one sequence are too few for 2 threads; of three sequences, enough
    try:
        for table, prompt in zip(tables, prompts):
            run(r, kv, [(table, 0, prompt)])
        alone = run(r, kv, [(tables[0], len(prompts[0]), [5])])[0]
        together = run(r, kv, [(t, len(p), [5 + i]) for i, (t, p) in enumerate(zip(tables, prompts))])[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


# ---- the engine ------------------------------------------------------------------------------------------------
def tiny_engine(blocks: int = 64, prefix_cache: bool = True, max_batch: int = 4, max_batched_tokens: int = 24,
                truth: dict | None = None, background: bool = True) -> Engine:
    """The int4 tiny target (native rows: the same arithmetic in any batch) on an engine with 8-token blocks of a
    float16 cache; `truth` (prompt -> prompt and output) adds speculation by the model-free drafters and an oracle's
    trees."""
    model, _ = tiny_target(max_seq_len=8)
    model.setup_rope(256)
    kv = KVCache.for_model(model.config, blocks * 8, torch.float16, block_size=8)  # the default KV type
    runner = NativeRunner.build(model, kv)
    if runner is None:
        pytest.skip("native kernels unavailable")
    config = SchedulerConfig(max_batch=max_batch, max_batched_tokens=max_batched_tokens, prefix_cache=prefix_cache)
    engine = Engine(model, kv, runner, 256, config, background=background)
    if truth is not None:
        drafters = lambda memory: [SuffixDrafter(memory=memory), NgramDrafter(), Oracle(truth)]  # noqa: E731
        engine.speculator = engine.scheduler.speculator = BatchSpeculator("test", drafters, Policy(flat_cost()))
    return engine


class Oracle(OracleDrafter):
    """The oracle of the lossless tests (right tokens, wrong siblings, a wrong token where it stops) for whichever
    request it is given, looked up by its prompt."""

    def __init__(self, truth: dict):
        super().__init__([], 128, tree=True)
        self.by_prompt = truth

    def start(self, prompt_ids, params=None):
        self.truth = self.by_prompt[tuple(prompt_ids)]


def collect(seq, abort_after: int | None = None, engine=None) -> list[int]:
    out = []
    while True:
        kind, value = seq.outbox.get(timeout=60)
        if kind == "error":
            raise value
        if kind == "finished":
            return out
        out += value
        if abort_after is not None and len(out) >= abort_after:
            engine.abort(seq)
            return out


def tiny_prompt(length: int, seed: int) -> list[int]:
    """Tokens of the tiny target's vocabulary (128), from a small alphabet so that drafts find repeats."""
    rng = random.Random(seed)
    return [rng.randrange(3, 40) for _ in range(length)]


def drain(seq) -> tuple[list[int], bool]:
    """What the engine posted so far -> (tokens, finished)."""
    out = []
    while not seq.outbox.empty():
        kind, value = seq.outbox.get()
        if kind == "error":
            raise value
        if kind == "finished":
            return out, True
        out += value
    return out, False


@pytest.mark.parametrize("seed", range(3))
def test_outputs_with_arrivals_cancellations_prefix_hits_preemption_and_drafts_equal_solo_runs(seed):
    rng = random.Random(seed)
    shared = tiny_prompt(20, seed=5)
    requests = []  # (prompt, params, cancel after this many tokens or None, arrival step)
    for i in range(14):
        prompt = (shared[:rng.choice([8, 13, 20])] if rng.random() < 0.6 else []) + tiny_prompt(rng.randint(1, 30),
                                                                                                100 * seed + i)
        sampled = rng.random() < 0.4
        params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, temperature=0.8 if sampled else 0,
                                seed=i if sampled else None)
        requests.append((prompt, params, rng.choice([None, None, None, 3]), rng.randrange(40)))
    reference = tiny_engine(blocks=32, prefix_cache=False)
    solo = [collect(reference.add_request(prompt, params)) for prompt, params, _, _ in requests]
    reference.stop()
    # 16 blocks of 8 for up to 4 sequences of up to 90 tokens: preemption is certain.
    engine = tiny_engine(blocks=16, truth={tuple(r[0]): r[0] + s for r, s in zip(requests, solo)}, background=False)
    steps, preempted = [], []
    forward, preempt = engine.runner.forward, engine.scheduler.preempt
    engine.runner.forward = lambda batch: steps.append(batch) or forward(batch)
    engine.scheduler.preempt = lambda seq: preempted.append(seq) or preempt(seq)
    live, outputs, seqs = {}, {}, {}
    for step in range(2000):
        for i, (prompt, params, _, arrival) in enumerate(requests):
            if arrival == step:
                live[i] = seqs[i] = engine.add_request(prompt, params)
                outputs[i] = []
        engine.pump()
        for i, seq in list(live.items()):
            tokens, finished = drain(seq)
            outputs[i] += tokens
            cancel = requests[i][2]
            if finished or (cancel is not None and len(outputs[i]) >= cancel):
                if not finished:
                    engine.abort(seq)
                del live[i]
        if step > 40 and not live and not engine.scheduler.has_work():
            break
    assert len(outputs) == len(requests) and not live
    for i, ((prompt, params, cancel, _), alone) in enumerate(zip(requests, solo)):
        assert outputs[i] == alone[:len(outputs[i])], f"request {i}"
        if cancel is None:
            assert len(outputs[i]) == params.max_tokens
        else:  # one step may have emitted several tokens (a verified draft) before the cancel took effect
            assert len(outputs[i]) >= min(cancel, params.max_tokens)
    assert all(r == 0 for r in engine.kv.refs), "a finished or cancelled request kept a block"
    assert any(len(b.context) > 1 for b in steps), "no two sequences ever shared a forward pass"
    assert any(len(b.context) > 1 and b.tree_mask is not None for b in steps), "no draft tree beside another sequence"
    assert any(b.num_rows > len(b.context) + 1 and len(b.context) > 1 for b in steps), "no chunk or draft in a batch"
    assert preempted, "the small cache never forced a preemption"
    assert any(seq.timings.cached_tokens for seq in seqs.values()), "no request hit the prefix cache"
    assert sum(seq.speculation.stats.accepted for seq in seqs.values()) > 0, "no draft token was ever accepted"


def test_prompts_share_a_step_evenly_and_a_short_one_leaves_the_rest_to_the_others():
    assert fair_shares([100, 5, 100], 24) == [9, 5, 10]
    assert fair_shares([3, 4], 24) == [3, 4]
    assert fair_shares([50, 50, 50, 50], 2) == [0, 0, 1, 1]
    assert sum(fair_shares([7, 30, 1000], 64)) == 64


def test_a_short_prompt_is_not_queued_behind_a_long_prefill():
    # A subagent's short request arrives while the main conversation's long prompt is being prefilled in chunks:
    # it gets a share of the next step and its first token, long before the long prompt is done; both outputs equal
    # their solo runs.
    long, short = tiny_prompt(160, 1), tiny_prompt(6, 2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    reference = tiny_engine(blocks=32, prefix_cache=False)
    solo = [collect(reference.add_request(p, params)) for p in (long, short)]
    reference.stop()
    engine = tiny_engine(blocks=32, prefix_cache=False, background=False)  # steps of 24 rows
    first = engine.add_request(long, params)
    engine.pump()
    second = engine.add_request(short, params)
    outputs, first_token_step = {first: [], second: []}, {}
    for step in range(100):
        engine.pump()
        for seq in outputs:
            tokens, _ = drain(seq)
            outputs[seq] += tokens
            if tokens and seq not in first_token_step:
                first_token_step[seq] = step
        if all(seq.finished for seq in outputs):
            break
    assert [outputs[first], outputs[second]] == solo
    assert first_token_step[second] <= 1 < first_token_step[first]


def test_a_prefill_step_alone_keeps_the_models_floor_but_a_step_beside_decoding_does_not():
    # The rate measured on slow steps sizes the next chunk (a second's worth: 10 rows here); a mixture-of-experts
    # model's floor keeps a lone prompt's chunk long enough to spread its read of the experts; beside a decoding
    # sequence the chunk stays what keeps that sequence's next token near (a block).
    def chunk(floor: int, decoding: bool) -> list[int]:
        engine = tiny_engine(max_batched_tokens=64, background=False)
        if decoding:
            engine.add_request(tiny_prompt(5, 2), SamplingParams(max_tokens=50, ignore_eos=True))
            engine.pump()  # its prompt, and its first token: it decodes from now on
        engine.add_request(tiny_prompt(200, 1), SamplingParams(max_tokens=4, ignore_eos=True))
        engine.pump()  # a first chunk
        engine.config.min_prefill_rows, engine.scheduler.prefill_tok_s = floor, 10.0
        return sorted(w.rows for w in engine.scheduler.schedule())

    assert chunk(floor=0, decoding=False) == [10]
    assert chunk(floor=40, decoding=False) == [40]
    assert chunk(floor=40, decoding=True) == [1, 8]  # 10 rows/s for 0.3 s, at least a block


def test_the_prefill_floor_gives_each_expert_thirty_two_rows_on_average():
    moe = lambda e, k: ModelConfig(family="qwen3_moe", vocab_size=8, hidden_size=8, intermediate_size=8,  # noqa: E731
                                   num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8, num_experts=e,
                                   num_experts_per_tok=k)
    assert prefill_floor(moe(32, 4)) == 256 and prefill_floor(moe(128, 8)) == 512  # gpt-oss-20b, Qwen3-30B-A3B
    assert prefill_floor(moe(0, 0)) == 64  # dense: where the tiled matmuls run near their best


def test_a_request_larger_than_the_whole_cache_is_refused():
    engine = tiny_engine(blocks=4)
    with pytest.raises(InvalidRequestError, match="KV cache"):
        engine.add_request(tiny_prompt(20, 0), SamplingParams(max_tokens=20))


def test_a_cancelled_request_frees_its_blocks():
    engine = tiny_engine()
    seq = engine.add_request(tiny_prompt(30, 0), SamplingParams(max_tokens=200, ignore_eos=True))
    collect(seq, abort_after=2, engine=engine)
    deadline = time.time() + 10
    while not seq.finished and time.time() < deadline:
        time.sleep(0.01)
    engine.stop()
    assert seq.finish_reason == "abort"
    assert all(r == 0 for r in engine.kv.refs) and engine.kv.available == engine.kv.num_blocks


def test_token_ids_outside_the_vocabulary_are_refused():
    engine = tiny_engine()
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request([1, 2, 128], SamplingParams(max_tokens=2))
