"""The lab's modes: who sends which request when.

    sequential   one user, the workload in order (`repeats` passes)
    sweep        for each concurrency c: c users share a queue of c x requests_per_user items (closed loop: each
                 user sends its next request when the last one ends), giving per-user speed and total throughput;
                 `repeats` passes over the levels, each level's throughput the median of its passes
    soak         `soak_users` users cycle through the workload for `duration_s`: speed over time
    compare      two targets, A B A B on the same items, so that a machine's drift falls on both alike

Token counting waits until every request has ended: a tokenizer running inside the event loop would delay other
streams' chunks and so their timestamps.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from fastdecode.errors import FastdecodeError
from fastdecode.lab.client import Endpoint, payload, stream_chat
from fastdecode.lab.plan import new_nonce, with_nonce
from fastdecode.lab.records import RequestRecord
from fastdecode.lab.tokens import TokenCounter, assign_tokens
from fastdecode.workloads import WorkItem

MODES = ("sequential", "sweep", "soak", "compare")


@dataclass
class Target:
    endpoint: Endpoint
    counter: TokenCounter


@dataclass
class RunConfig:
    modes: tuple[str, ...] = ("sequential",)
    repeats: int = 1  # passes over the workload (sequential, compare) or over the levels (sweep)
    concurrency: tuple[int, ...] = (1, 2, 4, 8)  # sweep levels
    requests_per_user: int = 2  # sweep: each level sends concurrency x this many requests
    duration_s: float = 60.0  # soak
    soak_users: int = 1
    interval_s: float = 10.0  # bin width of the speed-over-time series
    warmup: int = 1  # requests per target sent before measuring and discarded (first load, compiled kernels)
    timeout_s: float = 300.0  # per request, connection to last byte
    unique_prompts: bool = False  # a nonce at the start of every prompt: no cache or drafter has seen it
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})  # merged into every request body
    window: int = 32  # tokens in the within-response floor window


class ProgressSink(Protocol):
    def phase(self, name: str, total: float | None) -> None: ...

    def advance(self, record: RequestRecord) -> None: ...


class NullProgress:
    def phase(self, name, total):
        pass

    def advance(self, record):
        pass


class Lab:
    def __init__(self, targets: dict[str, Target], items: list[WorkItem], cfg: RunConfig,
                 progress: ProgressSink | None = None):
        unknown = [m for m in cfg.modes if m not in MODES]
        if unknown:
            raise FastdecodeError(f"unknown mode {unknown[0]!r}; modes: {', '.join(MODES)}")
        if "compare" in cfg.modes and "B" not in targets:
            raise FastdecodeError("compare mode needs a second target (--b-endpoint or --b-local-model/--b-speculate)")
        self.targets, self.items, self.cfg = targets, items, cfg
        self.progress = progress or NullProgress()
        self.records: list[RequestRecord] = []
        self.pending: list[tuple[RequestRecord, Target, list[dict]]] = []
        self.t0 = 0.0

    async def run(self) -> list[RequestRecord]:
        users = max([*self.cfg.concurrency, self.cfg.soak_users, 1])
        limits = httpx.Limits(max_connections=users + 2, max_keepalive_connections=users + 2)
        timeout = httpx.Timeout(self.cfg.timeout_s, connect=10.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            self.client = client
            await self.warm_up()
            self.t0 = time.perf_counter()
            for mode in self.cfg.modes:
                await getattr(self, mode)()
        for record, target, messages in self.pending:
            assign_tokens(record, target.counter, messages)
        return self.records

    async def warm_up(self):
        if self.cfg.warmup <= 0:
            return
        arms = ["A", "B"] if "compare" in self.cfg.modes else ["A"]
        self.progress.phase("warm-up", self.cfg.warmup * len(arms))
        for item, arm in itertools.product(self.items[:self.cfg.warmup], arms):
            record = RequestRecord(item.id, item.category, phase="warmup", arm=arm)
            await stream_chat(self.client, self.targets[arm].endpoint, self.body(self.targets[arm], item), record,
                              self.cfg.timeout_s)
            self.progress.advance(record)

    def body(self, target: Target, item: WorkItem, messages: list[dict] | None = None) -> dict:
        return payload(target.endpoint, messages or item.messages, item.max_tokens, self.cfg.sampling)

    async def one(self, item: WorkItem, arm: str = "A", phase: str = "sequential", **fields) -> RequestRecord:
        target = self.targets[arm]
        messages = with_nonce(item.messages, new_nonce()) if self.cfg.unique_prompts else item.messages
        record = RequestRecord(item.id, item.category, phase=phase, arm=arm if phase == "compare" else "",
                               max_tokens=item.max_tokens, sent_at=time.perf_counter() - self.t0,
                               sent_unix=time.time(), **fields)
        await stream_chat(self.client, target.endpoint, self.body(target, item, messages), record, self.cfg.timeout_s)
        self.records.append(record)
        self.pending.append((record, target, messages))
        self.progress.advance(record)
        return record

    async def sequential(self):
        self.progress.phase("sequential", len(self.items) * self.cfg.repeats)
        for repeat, item in itertools.product(range(self.cfg.repeats), self.items):
            await self.one(item, phase="sequential", repeat=repeat)

    async def sweep(self):
        """Every level in turn, `repeats` times over (1, 2, 4, 8, 1, 2, 4, 8, ...), so that a machine's drift
        touches every level alike."""
        for repeat, c in itertools.product(range(self.cfg.repeats), self.cfg.concurrency):
            n = c * self.cfg.requests_per_user
            self.progress.phase(f"sweep, {c} users" + (f", pass {repeat + 1}/{self.cfg.repeats}"
                                                       if self.cfg.repeats > 1 else ""), n)
            queue: asyncio.Queue[WorkItem] = asyncio.Queue()
            for item in itertools.islice(itertools.cycle(self.items), n):
                queue.put_nowait(item)

            async def user(u: int, c: int = c, queue=queue, repeat=repeat):
                while not queue.empty():
                    await self.one(queue.get_nowait(), phase=f"c={c}", user=u, concurrency=c, repeat=repeat)

            await asyncio.gather(*(user(u) for u in range(c)))

    async def soak(self):
        c, duration = self.cfg.soak_users, self.cfg.duration_s
        self.progress.phase(f"soak, {c} users, {duration:g} s", None)
        deadline = time.perf_counter() + duration

        async def user(u: int):
            for item in itertools.islice(itertools.cycle(self.items), u, None):  # users start at different items
                if time.perf_counter() >= deadline:
                    return
                await self.one(item, phase="soak", user=u, concurrency=c)

        await asyncio.gather(*(user(u) for u in range(c)))

    async def compare(self):
        self.progress.phase("compare A B A B", 2 * len(self.items) * self.cfg.repeats)
        for _, item in itertools.product(range(self.cfg.repeats), self.items):
            for arm in ("A", "B"):
                await self.one(item, arm, phase="compare")
