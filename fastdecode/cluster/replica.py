"""One engine replica: a Ray Serve deployment that loads the model on its own cores and streams a request's chunks.

The server's process (the ingress) tokenizes, applies the chat template and formats the API's replies; a replica
only runs `LLM.astream` over token ids, so what crosses between them is small: token ids and sampling parameters in,
StreamChunks out. Its first item names the replica (`Started`), before the prefill, so that the ingress knows where
the request landed and can retry a request that has no token yet elsewhere if this replica dies.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from fastdecode.engine.grammar import GrammarProcessor
from fastdecode.engine.progress import PrefillLog
from fastdecode.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class ReplicaRequest:
    prompt_ids: list[int]
    params: SamplingParams
    processor: object  # the logits processor, as `shippable` makes it
    salt: str
    tenant: str | None


@dataclass(frozen=True)
class Started:
    replica: str  # the replica's id (Ray Serve's replica tag)


def shippable(processor):
    """A logits processor that can cross to a replica: a grammar's matcher is native state, so it travels as its
    source and the replica compiles it again (a few ms); logit_bias's closure pickles as it is."""
    if isinstance(processor, GrammarProcessor):
        return ("grammar", processor.source, sorted(processor.eos), processor.bias)
    return processor


def rebuild(shipped, grammars):
    """shippable's inverse, on the replica (`grammars`: its GrammarCompiler)."""
    if isinstance(shipped, tuple) and shipped and shipped[0] == "grammar":
        _, source, eos, bias = shipped
        return GrammarProcessor(grammars.matcher(source, eos), grammars.vocab_size, eos, bias, source)
    return shipped


def pin_cores(rank: int, threads: int) -> list[int] | None:
    """Replica `rank` (on this node) takes cores [rank * threads, (rank + 1) * threads) when the machine has them, so
    that replicas do not share cores; else it keeps what it has (None)."""
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[rank * threads:(rank + 1) * threads]
    if len(mine) < threads:
        return None
    os.sched_setaffinity(0, mine)
    return mine


class EngineReplica:
    """The deployment's class (cluster.deployment wraps it). `model`: build_llm's keyword arguments."""

    def __init__(self, model: dict):
        from ray import serve

        from fastdecode.engine.cli import build_llm
        from fastdecode.engine.grammar import GrammarCompiler

        context = serve.get_replica_context()
        self.tag = context.replica_tag
        threads = model.get("threads") or 1
        cores = pin_cores(context.rank.local_rank, threads)
        log.info("replica %s: %d threads on cores %s", self.tag, threads, cores or "shared")
        self.llm = build_llm(**model)
        self.grammars = GrammarCompiler(self.llm.tokenizer)
        self.prompt_tokens = self.cached_tokens = 0  # of the requests finished here: the cache's hit rate

    def describe(self) -> dict:
        """What the ingress needs to check and format requests without the model: it loads only the tokenizer."""
        llm = self.llm
        return {"name": llm.name, "path": str(llm.path), "config": llm.config, "context": llm.context,
                "speculate": llm.speculate}

    async def generate(self, request: ReplicaRequest, route=None):
        """`route` is the router's (router.py), not ours."""
        yield Started(self.tag)
        stream = self.llm.astream(request.prompt_ids, request.params, rebuild(request.processor, self.grammars),
                                  salt=request.salt, tenant=request.tenant, on_prefill=PrefillLog(log))
        try:
            async for chunk in stream:
                if chunk.completion is not None:
                    self.prompt_tokens += chunk.completion.timings.prompt_tokens
                    self.cached_tokens += chunk.completion.timings.cached_tokens
                yield chunk
        finally:  # the ingress cancelled (its client left) or the stream ended: the engine frees the request
            stream.close()

    def record_routing_stats(self) -> dict:
        """Ray Serve polls this for the router: the engine's load and its prefix cache's hits so far."""
        engine = self.llm.engine
        kv = engine.kv
        return {"pid": os.getpid(), "running": engine.num_running, "waiting": engine.num_waiting,
                "kv_used_tokens": (kv.num_blocks - kv.available) * kv.block_size, "kv_capacity_tokens": kv.capacity,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}

    def check_health(self):
        thread = self.llm.engine.thread  # (None until the first request)
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the engine's thread has stopped")
