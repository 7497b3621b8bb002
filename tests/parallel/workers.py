"""What each rank runs in the spawned tests (module-level, so that spawned processes can import it)."""
from __future__ import annotations

import torch

from fastdecode.engine.sampling import SamplingParams
from fastdecode.parallel.collectives import collectives
from fastdecode.parallel.load import load_shard
from fastdecode.parallel.shard import install_collectives


@torch.no_grad()
def greedy_run(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """tests.helpers.checkpoints.our_run without importing transformers (seconds per spawned process):
    -> (prefill logits (P, vocab), greedy tokens, decode-step logits (steps, vocab))."""
    model.setup_cache(len(prompt) + steps + 1)
    prefill = model(torch.tensor([prompt]), start=0, all_logits=True)[0].float()
    tokens, step_logits = [int(prefill[-1].argmax())], []
    for i in range(steps):
        logits = model(torch.tensor([[tokens[-1]]]), start=len(prompt) + i)[0, -1].float()
        step_logits.append(logits)
        tokens.append(int(logits.argmax()))
    return prefill, tokens, torch.stack(step_logits)


def oracle_speculator(llm, truth: list[int]):
    """A tree drafter that knows the answer but puts a wrong sibling before each right token, verified in full:
    accepted paths leave the first branch, so the cache moves run on every rank (the paged cache's mirror)."""
    from fastdecode.speculative.batch import BatchSpeculator
    from fastdecode.speculative.policy import Policy
    from tests.speculative.helpers import OracleDrafter, flat_cost

    llm.engine.speculator = llm.engine.scheduler.speculator = BatchSpeculator(
        "oracle", lambda memory: [OracleDrafter(truth, llm.config.vocab_size, tree=True)],
        Policy(flat_cost(), adaptive=False))


def concurrent_greedy(llm, prompts: list[list[int]], steps: int) -> list[tuple[list[int], int]]:
    """Every prompt submitted at once to the engine -> (tokens, cached prompt tokens) per prompt."""
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    streams = [llm.stream(p, params) for p in prompts]
    out = []
    for stream in streams:
        completion = [c for c in stream][-1].completion
        out.append((completion.token_ids, completion.timings.cached_tokens))
    return out


def tiny_models(rank: int, world: int, cases: list[tuple], prompt: list[int], steps: int,
                batch: list[list[int]]) -> dict:
    """Each case (name, safetensors dir, GGUF file, speculation settings, TP=1 tokens): the sharded model's prefill
    and cached greedy decode from safetensors (every rank runs it; their collectives pair up), then ParallelLLM from
    GGUF, rank 0 driving, once per speculation setting. "batch": the `batch` prompts at once (after one of them
    alone, so the others find its prefix cached). -> {name: {"run": greedy_run(), spec: (tokens, speculation
    stats), "batch": [(tokens, cached tokens)] }} on rank 0."""
    from fastdecode.parallel.llm import ParallelLLM

    out = {}
    for name, hf_dir, gguf_path, speculations, truth in cases:
        model = install_collectives(load_shard(hf_dir, rank, world), collectives(rank, world, 60))
        out[name] = {"run": greedy_run(model, prompt, steps)}
        for spec in speculations:
            speculate = {"oracle": "none", "batch": "none", "batch_layerskip": "layerskip"}.get(spec, spec)
            llm = ParallelLLM(gguf_path, tp=world, max_seq_len=96, speculate=speculate, timeout_s=60)
            if not llm.leads:
                llm.follow()
                continue
            if spec == "oracle":
                oracle_speculator(llm, prompt + truth)
            elif llm.engine.speculator is not None:
                # Draft at every step: the adaptive policy weighs measured step times, so whether it drafts in a
                # 16-token run would depend on how busy the machine is (test_speculation_under_tp_... flaked).
                llm.engine.speculator.policy.adaptive = False
            if spec.startswith("batch"):
                first = concurrent_greedy(llm, batch[:1], steps)
                out[name][spec] = first + concurrent_greedy(llm, batch[1:], steps)
                out[name]["decode_path"] = llm.decode_path
            else:
                c = llm.generate(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
                out[name][spec] = (c.token_ids, c.speculation)
            llm.close()
    return out


def real_model(rank: int, world: int, path: str, plain: str, speculative: str, max_tokens: int) -> dict:
    """ParallelLLM on a real model, rank 0 driving. Float shards: one prompt with plain decoding and another with
    n-gram speculation on the engine (the drafter on rank 0; a flat verify cost instead of the start-up measurement,
    to save time). The file's own blocks (the default): the second prompt, plain, with each token's top-2 logprobs."""
    from fastdecode.parallel.llm import ParallelLLM
    from fastdecode.speculative.batch import MODEL_FREE, BatchSpeculator
    from fastdecode.speculative.policy import CostModel, Policy

    out = {}
    for quant in ("none", None):
        llm = ParallelLLM(path, tp=world, quant=quant, max_seq_len=256, timeout_s=60)
        if not llm.leads:
            llm.follow()
            continue
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        if quant is None:
            params.logprobs = 2
            out["gguf"] = llm.generate(speculative, params).logprobs
            llm.close()
            continue
        out["none"] = llm.generate(plain, params).token_ids
        llm.engine.speculator = llm.engine.scheduler.speculator = BatchSpeculator(
            "ngram", MODEL_FREE["ngram"], Policy(CostModel([1, 64], [1.0, 1.0])))
        completion = llm.generate(speculative, params)
        out.update(ngram=completion.token_ids, accepted=completion.speculation["accepted"])
        llm.close()
    return out


def gguf_shards(rank: int, world: int, paths: list[str], prompt: list[int]) -> dict:
    """Each GGUF file's shard in the file's own formats (quant "gguf") -> {path: {"logits": greedy_run's prefill
    logits, "kinds": the module types of layer 0's matrices and the embedding's lookup}}."""
    out = {}
    for path in paths:
        model = install_collectives(load_shard(path, rank, world, quant="gguf"), collectives(rank, world, 60))
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        kinds = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj, "down_proj": mlp.down_proj,
                 "embedding": model.embed_tokens.rows}
        out[path] = {"logits": greedy_run(model, prompt, 2)[0],
                     "kinds": {name: type(m).__name__ for name, m in kinds.items()}}
    return out
