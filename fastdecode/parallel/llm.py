"""`ParallelLLM`: the LLM API over a model sharded across the ranks of a process group.

Every rank builds one (each loads only its shard); rank 0's is then used like any LLM (generate, stream, chat, a
server; on the serving engine, through parallel/runner.py), while every other rank calls `follow()`, which returns
when rank 0 calls `close()`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fastdecode.engine.llm import KV_DTYPES, LLM, Context, kv_budget_tokens
from fastdecode.errors import InvalidRequestError
from fastdecode.loading.catalog import DEFAULT_MODEL, resolve
from fastdecode.parallel.driver import Leader, follow
from fastdecode.parallel.group import DEFAULT_TIMEOUT_S, init_group
from fastdecode.parallel.load import checkpoint_config, load_shard
from fastdecode.parallel.plan import ShardPlan
from fastdecode.parallel.runner import ParallelRunner
from fastdecode.parallel.shard import install_collectives
from fastdecode.runners import build_runner
from fastdecode.speculative.batch import HEADS


class ParallelLLM(LLM):
    def __init__(self, model: str = DEFAULT_MODEL, tp: int = 2, quant: str | None = None, speculate: str = "none",
                 timeout_s: float = DEFAULT_TIMEOUT_S, on_failure=None, progress=None, log=lambda *a: None, **kw):
        """kw: LLM's dtype, group_size, threads, max_seq_len, and the engine's max_batch, kv_cache_gb, prefix_cache,
        kv_dtype, native. Everything runs on the serving engine, each rank the native C++ step over its shard where
        the kernels are built (else PyTorch's modules), its layers' outputs all-reduced; the drafters run on rank 0
        (draft:MODEL's model whole, there). quant as LLM's: by default a GGUF file's own formats, each rank its cut of
        the blocks (parallel/load.py). `on_failure(error)`: see Leader."""
        # A model that cannot be split fails here, before the ranks meet (and without torchrun too).
        path = resolve(model)
        config = checkpoint_config(path, quant)[0]
        ShardPlan.build(config, 0, tp)
        if speculate and speculate.partition(":")[0] in HEADS:
            raise InvalidRequestError("--speculate eagle reads the target's embedding, which --tp splits: use "
                                      "auto, layerskip or draft:MODEL")
        self.group = group = init_group(tp, timeout_s)
        self.on_failure = on_failure
        lead = group.leads
        if kw.get("max_seq_len") is None:  # the ranks must agree: the smallest context any rank's KV budget holds
            # as one process sizes it: the KV cache's dtype (an unknown one is LLM's error to give), --kv-cache-gb
            kv_dtype = KV_DTYPES.get(kw.get("kv_dtype") or "float16", torch.float16)
            budget = kv_budget_tokens(config, kv_dtype, kw.get("kv_cache_gb"))
            tokens = torch.tensor([Context.choose(config.max_position_embeddings, None, budget).tokens])
            dist.all_reduce(tokens, dist.ReduceOp.MIN, group=group.pg)
            kw["max_seq_len"] = int(tokens)
        # Each rank would keep its own shard's blocks on disk, under one name: not built yet, so no disk tier.
        kw["kv_disk_gb"] = 0

        def load(path, dtype, progress, quant):  # "gguf": the file's blocks, cut; else float, which LLM quantizes
            return load_shard(path, group.rank, group.world, dtype, progress, quant)
        # Drafters run on rank 0 only: the others run what its steps send them.
        super().__init__(model, quant=quant, speculate=speculate if lead else "none",
                         progress=progress if lead else None, log=log if lead else (lambda *a: None), load=load, **kw)
        if lead:
            self.leader.keep_alive(group.timeout_s / 2)

    def _kv_tokens(self, kv_cache_gb, max_batch, kv_dtype) -> int:
        """Rank 0 hands out blocks for every rank's cache: each must hold as many (an uneven split of the KV heads
        gives the ranks different bytes per token)."""
        tokens = torch.tensor([super()._kv_tokens(kv_cache_gb, max_batch, kv_dtype)])
        dist.all_reduce(tokens, dist.ReduceOp.MIN, group=self.group.pg)
        return int(tokens)

    def _runner(self, kv, native):
        """The runner of one process over this rank's shard (its collectives installed after any quantization), the
        native step's layers summed across the ranks by `reduce`; on rank 0 wrapped to send each step to the others
        through the Leader that commands them."""
        install_collectives(self.model, self.group.comm)
        runner = build_runner(self.model, kv, native, reduce=self.model.all_reduce)
        if not self.leads:
            return runner
        self.leader = Leader(self.group, self.on_failure)
        return ParallelRunner(runner, self.leader)

    @property
    def leads(self) -> bool:
        return self.group.leads

    def follow(self):
        """Ranks > 0: run rank 0's steps until it closes."""
        follow(self.model, self.group, self.runner)

    def close(self):
        """Rank 0: stop the engine, then release the followers (their follow() returns)."""
        if self.leads:
            super().close()
            self.leader.stop()
