"""The engine on the real GGUF models against transformers loading the same file."""
import asyncio
import threading
import time

import pytest
import torch

from fastdecode import LLM, SamplingParams
from fastdecode.engine.kv_cache import BLOCK_SIZE
from fastdecode.engine.llm import Context
from fastdecode.engine.progress import PrefillLog
from fastdecode.engine.scheduler import SchedulerConfig
from fastdecode.errors import InvalidRequestError

PROMPTS = [
    "def quicksort(arr):\n",
    "The three laws of thermodynamics are",
    "<|im_start|>user\nWrite a SQL query that counts users per country.<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY_TOKENS = 64


def reference(path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request):
    path = request.getfixturevalue(f"{request.param}_path")
    llm = LLM(str(path), quant="none", max_seq_len=512)  # float weights: transformers dequantizes the file too
    return llm, reference(path)


def test_logits_match_transformers(pair):
    llm, ref = pair
    ids = llm.encode_prompt(PROMPTS[0])
    llm.model.setup_cache(llm.max_seq_len)
    with torch.inference_mode():
        ours = llm.model(torch.tensor([ids]), 0, all_logits=True)
        theirs = ref(torch.tensor([ids])).logits
    assert (ours - theirs).abs().max().item() <= 1e-3


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_identical_to_transformers(pair, prompt):
    llm, ref = pair
    ids = llm.encode_prompt(prompt)
    ours = llm.generate(ids, SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)).token_ids
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                           do_sample=False)
    assert ours == out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return LLM(str(smollm2_path), max_seq_len=256)


def test_stream_joins_to_generate_text_and_carries_timings(smollm2):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    chunks = list(smollm2.stream("Hello, my name is", params))
    done = chunks[-1].completion
    assert "".join(c.text for c in chunks) == done.text == smollm2.generate("Hello, my name is", params).text
    t = done.timings
    assert t.output_tokens == 24 and t.prompt_tokens == len(done.prompt_token_ids)
    assert t.ttft_s > 0 and t.prefill_tok_s > 0 and t.output_tok_s > 0
    assert done.finish_reason == "length"


def test_chat_stops_at_end_of_turn(smollm2):
    done = smollm2.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=200))
    assert done.finish_reason == "stop" and len(done.token_ids) < 200
    assert "<|im_end|>" not in done.text


def test_stop_string_ends_generation(smollm2):
    done = smollm2.generate("1, 2, 3, 4,", SamplingParams(max_tokens=40, stop=["7"]))
    assert done.finish_reason == "stop" and "7" not in done.text


def test_seeded_sampling_is_reproducible(smollm2):
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    assert smollm2.generate("Once upon a time", params).token_ids == smollm2.generate("Once upon a time", params).token_ids


def test_prompt_longer_than_context_is_rejected_naming_the_flag_that_raises_it(smollm2):
    with pytest.raises(InvalidRequestError, match=r"exceeds the context of 256 tokens \(--max-seq-len raises it, up "
                                                  r"to the model's 8,192\)"):
        smollm2.generate("word " * 300, SamplingParams(max_tokens=8))


def test_the_context_defaults_to_the_trained_one_as_far_as_the_kv_budget_holds(smollm2_path):
    llm = LLM(str(smollm2_path))
    assert (llm.max_seq_len, llm.context.set_by) == (8192, "trained")
    assert llm.kv.capacity >= 8192
    # A budget of 0.05 GB holds 2,170 of SmolLM2's 23,040-byte tokens: the context is what fits, in whole blocks.
    small = LLM(str(smollm2_path), kv_cache_gb=0.05, max_batch=1)
    assert (small.max_seq_len, small.context.set_by) == (2170 // BLOCK_SIZE * BLOCK_SIZE, "kv budget")
    with pytest.raises(InvalidRequestError, match="--kv-cache-gb raises it"):
        small.generate("word " * 3000, SamplingParams(max_tokens=8))


@pytest.mark.parametrize("trained, requested, budget, expected", [
    (32768, None, 10**6, (32768, "trained")),  # the budget holds it: the model's own
    (131072, None, 65541, (65536, "kv budget")),  # it does not: what it holds, in whole blocks
    (32768, 4096, 100, (4096, "--max-seq-len")),  # asked for: the cache then makes room
    (8192, 100000, 100, (8192, "trained")),  # never past the trained context
])
def test_context_choice(trained, requested, budget, expected):
    context = Context.choose(trained, requested, budget)
    assert (context.tokens, context.set_by) == expected
    assert f"{context.tokens:,}" in context.describe()


def test_bfloat16_weights_run_on_the_paged_engine(smollm2_path):
    # --dtype bfloat16 without a quantization: float weights in bfloat16 on the PyTorch runner, attention in the
    # model's dtype (the rotary tables are float32, and the output projection was handed float32 rows)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    f32, bf16 = (LLM(str(smollm2_path), dtype=dtype, quant="none", max_seq_len=128, speculate="none").generate(
        PROMPTS[0], params) for dtype in ("float32", "bfloat16"))
    assert len(bf16.token_ids) == 4 and bf16.token_ids[0] == f32.token_ids[0]


def test_long_prompt_is_prefilled_in_chunks_like_one_pass(smollm2_path):
    from fastdecode.engine.scheduler import SchedulerConfig
    ids = LLM(str(smollm2_path), max_seq_len=8).encode_prompt("def f(x):\n    return x * 2\n" * 6)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    runs = [LLM(str(smollm2_path), quant="int4", max_seq_len=128, prefix_cache=False,
                scheduler=SchedulerConfig(max_batched_tokens=chunk)).generate(ids, params) for chunk in (1024, 16)]
    assert len(ids) > 3 * 16  # several chunks
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].logprobs == runs[1].logprobs  # int4 rows: the same arithmetic in any chunk


def test_a_long_prefill_reports_its_progress_until_the_first_token(smollm2_path):
    llm = LLM(str(smollm2_path), max_seq_len=4096, scheduler=SchedulerConfig(max_batched_tokens=64))
    prompt = list(range(1000, 4500))  # 3,500 tokens in steps of 64 rows: seconds of prefill
    reports = []
    chunks = llm.stream(prompt, SamplingParams(max_tokens=3),
                        on_prefill=lambda done, total: reports.append((done, total)))
    first = next(chunks)
    assert first.token_ids and reports[-1] == (3500, 3500)  # the last report: done, at the first token
    during = [done for done, _ in reports[:-1]]
    # A poll may land between the last chunk's step and its token's arrival, and see every token done.
    assert len([d for d in during if 0 < d < 3500]) >= 2 and during == sorted(during) and during[-1] <= 3500
    assert all(total == 3500 for _, total in reports)
    list(chunks)
    assert len(reports) == len(during) + 1  # nothing after the first token
    llm.close()


def test_prefill_log_writes_a_line_every_period_and_one_at_the_end():
    lines = []
    log = PrefillLog(type("Log", (), {"info": lambda self, fmt, *a: lines.append(fmt % a)})(), every_s=0.05)
    log(0, 1000)
    assert lines == []  # under a period: nothing
    time.sleep(0.06)
    log(400, 1000)
    assert len(lines) == 1 and lines[0].startswith("prefill 400/1,000 tokens (40%), ") and "s left" in lines[0]
    log(1000, 1000)
    assert len(lines) == 2 and lines[1].startswith("prefilled 1000 tokens in ")


def test_a_cancelled_stream_leaves_the_engine_mid_prefill(smollm2_path):
    """A client that leaves while its long prompt is prefilled (no token has come to close the stream on) is dropped
    within a step, not when its first token comes."""
    llm = LLM(str(smollm2_path), max_seq_len=4096, scheduler=SchedulerConfig(max_batched_tokens=64))
    prompt = list(range(1000, 4500))  # 3,500 tokens in steps of 64 rows: seconds of prefill
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t0 = time.perf_counter()
    *_, last = llm.stream(prompt, SamplingParams(max_tokens=4), cancel=cancel)
    waited = time.perf_counter() - t0
    deadline = time.monotonic() + 2
    while llm.engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert last.completion.token_ids == [] and llm.engine.num_running == 0
    assert waited < 1.5, f"the stream ended {waited:.2f} s after it started, 0.3 s after it was cancelled"
    llm.close()


def test_the_asyncio_stream_gives_the_blocking_streams_chunks_alone_and_side_by_side(smollm2):
    """LLM.astream: the same chunks as stream(), with stop strings, logprobs and the last Completion; two read at once
    on one event loop are batched by the engine and each equals its own solo run."""
    cases = [("Hello, my name is", SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1)),
             ("1, 2, 3, 4,", SamplingParams(max_tokens=40, stop=["7"]))]

    async def read(prompt, params):
        return [c async for c in smollm2.astream(prompt, params)]

    async def both():
        return await asyncio.gather(*(read(p, s) for p, s in cases))

    for (prompt, params), chunks in zip(cases, asyncio.run(both())):
        blocking = list(smollm2.stream(prompt, params))
        assert [(c.text, c.token_ids, c.logprobs) for c in chunks] == [
            (c.text, c.token_ids, c.logprobs) for c in blocking]
        ours, theirs = chunks[-1].completion, blocking[-1].completion
        assert (ours.text, ours.token_ids, ours.finish_reason) == (theirs.text, theirs.token_ids, theirs.finish_reason)
    assert asyncio.run(both())[1][-1].completion.finish_reason == "stop"


def test_closing_or_cancelling_an_asyncio_stream_ends_it_in_the_engine_mid_prefill(smollm2_path):
    """The server's reader of a long prompt: closed (a time limit) or its task cancelled (a client that left), the
    request leaves the engine within a step; the reader of a closed stream gets its end at once."""
    llm = LLM(str(smollm2_path), max_seq_len=4096, scheduler=SchedulerConfig(max_batched_tokens=64))
    prompt = list(range(1000, 4500))  # 3,500 tokens in steps of 64 rows: seconds of prefill

    async def closed():
        stream = llm.astream(prompt, SamplingParams(max_tokens=4))
        asyncio.get_running_loop().call_later(0.3, stream.close)
        t0 = time.perf_counter()
        chunks = [c async for c in stream]
        return chunks, time.perf_counter() - t0

    async def cancelled():
        reader = asyncio.ensure_future(anext(llm.astream(prompt, SamplingParams(max_tokens=4))))
        await asyncio.sleep(0.3)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

    def engine_empty() -> bool:
        deadline = time.monotonic() + 2
        while llm.engine.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        return llm.engine.num_running == 0

    chunks, waited = asyncio.run(closed())
    assert [c.completion.token_ids for c in chunks] == [[]] and engine_empty() and waited < 1.5
    asyncio.run(cancelled())
    assert engine_empty()
    llm.close()
