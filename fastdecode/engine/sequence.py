"""One request inside the engine: its tokens, how many of them the KV cache holds, its blocks, its sampler and its
outbox of events for whoever waits on it."""
from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass, field
from typing import Callable

from fastdecode.engine.timings import Timings
from fastdecode.engine.kv_cache import BlockTable
from fastdecode.engine.sampling import Sampler, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (its blocks given back; it computes its tokens again when readmitted)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    sampler: Sampler
    stop_ids: set[int]
    salt: str = ""  # prefix-cache namespace: requests share cached blocks only within one salt
    tenant: str | None = ""  # drafters' cross-request memory is shared within a tenant; None: this request only
    tokens: list[int] = field(default_factory=list)  # prompt and output so far
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens[:num_computed] have their keys and values in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    timings: Timings = field(default_factory=Timings)
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    speculation: object | None = None  # speculative.batch.SequenceDrafts when the engine speculates
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    notify: Callable[[], None] | None = None  # called after each post: an asyncio reader's wake-up (LLM.astream)

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache: the prompt's rest while prefilling, then the last sampled token."""
        return len(self.tokens) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def post(self, kind: str, value=None):
        """("tokens", [ids]), then one of ("finished", reason) or ("error", exception)."""
        self.outbox.put((kind, value))
        if self.notify is not None:
            try:
                self.notify()
            except RuntimeError:  # the reader's event loop is closed: nobody is left to wake
                pass
