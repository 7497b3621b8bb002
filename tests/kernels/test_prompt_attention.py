"""Prompt rows' attention on the prompt kernel (taken where Batch.prompt_end marks a row as its prompt's): bf16
products where the CPU has AVX512-BF16 (kernels/attention_bf16.h), float32 with queries in the lanes in the AVX2 build
(kernels/attention_lanes.h). Within the kernel's rounding of the float kernel and of transformers, and a row's result
the same bits however its prompt is chunked and whatever shares its batch, so prefix hits, batching and preemption stay
exact. Generated rows keep the float kernel."""
from pathlib import Path

import pytest
import torch

from fastdecode import kernels
from fastdecode.engine.kv_cache import BlockTable
from fastdecode.kernels import native_ops
from fastdecode.loading import load_model, load_tokenizer
from fastdecode.quant import quantize_model
from tests.helpers.checkpoints import checkpoint, max_diff, prompt_tokens, reference_run, single_thread
from tests.helpers.paged import paged, run

PROMPT = prompt_tokens(600)  # past two of the kernel's 256-key chunks
MODELS = ["llama_k", "gemma3_64"]  # grouped heads; sliding windows of 40 (heads of 64 both)


# Per kernel, as shares of the logits' largest: the most its rows may differ from the float kernel's and from
# transformers', and the mean of the former. Measured (float16 KV; llama_k, gemma3_64): bf16 2.3% and 0.5% off
# transformers at most (a mean of 0.2% and 0.06%), the float kernel 0.25% and 0.05%; float32 lanes 7.7e-5 and
# 4.7e-5 off the float kernel at most (a mean of 2.4e-6 and 4.4e-6: the order of its sums), 0.25% and 0.05% off
# transformers, as the float kernel.
TOLERANCE = {"bf16": (0.04, 0.04, 0.005), "float32 lanes": (3e-4, 0.005, 2e-5)}


@pytest.fixture(scope="module", autouse=True)
def prompt_kernel():
    ops = native_ops()
    kernel = ops.prompt_attention()[0] if ops is not None else ""
    if not kernel:
        pytest.skip("no native kernels, or the prompt kernel is switched off: prompt rows take the float kernel")
    with single_thread():
        yield kernel


def fresh(name: str, int4: bool):
    """The model over a float16 paged cache; int4: its matrices on our kernels, whose rows are the same bits in any
    batch (ATen's float matmul rounds a row by the rows beside it)."""
    model = load_model(checkpoint(name).hf_dir)
    return paged(quantize_model(model, "int4") if int4 else model, "native", blocks=96, block_size=16,
                 dtype=torch.float16, positions=1024)


def prefill(name: str, chunks: list[int], prompt_end: int | None, int4: bool = True) -> torch.Tensor:
    """The prompt's logits, every row, fed in chunks of the given sizes (the rest in one)."""
    r, kv = fresh(name, int4)
    table, out, at = BlockTable(), [], 0
    for n in [*chunks, len(PROMPT) - sum(chunks)]:
        (logits,) = run(r, kv, [(table, at, PROMPT[at:at + n])], None if prompt_end is None else [prompt_end])
        out.append(logits)
        at += n
    return torch.cat(out)


@pytest.mark.parametrize("name", MODELS)
def test_prompt_rows_are_within_the_kernels_rounding_of_the_float_kernel_and_transformers(name, prompt_kernel):
    prompt, float32 = prefill(name, [], len(PROMPT), int4=False), prefill(name, [], None, int4=False)
    reference = reference_run(checkpoint(name).model, PROMPT, 1).prefill_logits
    scale = reference.abs().max().item()
    off_float, off_reference, mean_off_float = TOLERANCE[prompt_kernel]
    assert not torch.equal(prompt, float32), "prompt rows did not take the prompt kernel"
    assert max_diff(float32, reference) <= 0.005 * scale
    assert max_diff(prompt, float32) <= off_float * scale
    assert (prompt - float32).abs().mean().item() <= mean_off_float * scale
    assert max_diff(prompt, reference) <= off_reference * scale
    assert (prompt.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("name", MODELS)
def test_a_prompt_rows_result_does_not_depend_on_its_chunking_or_batch(name):
    whole = prefill(name, [], len(PROMPT))
    assert torch.equal(prefill(name, [1, 37, 256, 7], len(PROMPT)), whole)
    # Beside another prompt's chunk and a decode row of a third sequence (whose rows are all generated ones).
    r, kv = fresh(name, int4=True)
    other, third, mine = BlockTable(), BlockTable(), BlockTable()
    run(r, kv, [(third, 0, PROMPT[:100])], [100])
    got = []
    for at, n in [(0, 300), (300, 300)]:
        (logits, _, _) = run(r, kv, [(mine, at, PROMPT[at:at + n]), (other, at // 3, prompt_tokens(100, seed=at + 1)),
                                     (third, 100 + at // 300, [5])], [len(PROMPT), 1000, 100])
        got.append(logits)
    assert torch.equal(torch.cat(got), whole)


@pytest.mark.parametrize("name", MODELS)
def test_generated_rows_keep_the_float_kernel(name):
    """Rows at or past prompt_end (decode, verify, a recompute of output after preemption) are computed as without
    it, so speculation stays lossless."""
    steps = []
    for prompt_end in (len(PROMPT), None):
        r, kv = fresh(name, int4=True)
        table = BlockTable()
        run(r, kv, [(table, 0, PROMPT)], [len(PROMPT)])  # the same cache before the steps either way
        steps.append(torch.cat([run(r, kv, [(table, len(PROMPT) + i, [7 + i, 9])],
                                    None if prompt_end is None else [prompt_end])[0] for i in range(0, 6, 2)]))
    assert torch.equal(*steps)


def test_on_smollm2_the_prompt_kernel_leaves_the_texts_likelihood_as_it_was(smollm2_path):
    """Real weights and real text: 1,500 tokens of this repository's source, prefilled in chunks of 512 with prompt
    rows on the prompt kernel and on the float one. Measured with bf16: mean next-token loss 2.3135 against 2.3131
    nats over 3,000 tokens, 99.5% of the argmaxes equal, mean KL 8e-5."""
    path = smollm2_path
    source = Path(kernels.__file__).parent / "decode_step.cpp"
    ids = load_tokenizer(path).encode(source.read_text())[:1500]
    model = load_model(path)
    logits = {}
    for prompt_end in (len(ids), None):
        r, kv = paged(model, "native", blocks=100, block_size=16, dtype=torch.float16, positions=len(ids) + 16)
        table = BlockTable()
        logits[prompt_end] = torch.cat([run(r, kv, [(table, at, ids[at:at + 512])], prompt_end and [prompt_end])[0]
                                        for at in range(0, len(ids), 512)])
    prompt, float32 = logits[len(ids)], logits[None]
    target = torch.tensor(ids[1:])[:, None]
    loss = [-torch.log_softmax(x[:-1], -1).gather(1, target).mean().item() for x in (prompt, float32)]
    assert not torch.equal(prompt, float32)
    assert abs(loss[0] - loss[1]) <= 0.005
    assert (prompt.argmax(-1) == float32.argmax(-1)).float().mean() >= 0.98
