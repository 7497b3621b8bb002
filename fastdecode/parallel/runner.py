"""Tensor parallelism as a runner: rank 0's engine steps through `ParallelRunner`, which sends each step's batch to
the other ranks before running its own shard; every rank runs the same runner (the native step with an all-reduce
callback, or PyTorch's modules) over its shard of the model and its own paged KV cache (its KV heads only), whose
blocks rank 0's scheduler hands out for all of them. So tensor parallelism gets what one process gets from the
engine: batching, the prefix cache, chunked prefill, speculation. The layers' all-reduces pair up across
the ranks; so do the LM head's (each rank runs its vocabulary slice on the step's logit rows) and every move the
engine makes in the cache (KVCache.mirror)."""
from __future__ import annotations

from fastdecode.parallel.driver import Leader
from fastdecode.runners import Batch


class ParallelRunner:
    def __init__(self, runner, leader: Leader):
        self.runner, self.leader = runner, leader
        self.kv, self.name = runner.kv, runner.name
        self.kv.mirror = leader.move_slots

    def forward(self, batch: Batch, stop: int | None = None):
        """-> this rank's hidden states (R, D) after layers [0, stop), the same on every rank after the layers'
        all-reduces."""
        return self.leader.step(batch, lambda b: self.runner.forward(b, stop), stop)

    def forward_taps(self, batch: Batch, taps: list[int]):
        """The other ranks run the plain forward: the same layers and all-reduces, in one call."""
        return self.leader.step(batch, lambda b: self.runner.forward_taps(b, taps))
