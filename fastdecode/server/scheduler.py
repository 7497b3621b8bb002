"""Requests in a bounded first-in-first-out queue in front of the engine, `slots` of them generating at once.

Each slot is a worker thread that takes the next request in arrival order and iterates its stream (`LLM.stream`),
handing each chunk to the request's asyncio queue on the event loop. The engine batches whatever streams are open
(continuous batching), so `slots` is its batch size; a model that runs one request at a time (tensor parallelism, a
model drafter) gets one slot. A request whose client went away, or whose time ran out, is dropped from the queue or
has its stream stopped (LLM.stream's `cancel`: within a step, even mid-prefill), which frees its place in the engine.
"""
from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from fastdecode.engine.llm import StreamChunk


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: {retry_after} s")
        self.retry_after = retry_after


class QueueTimeout(Exception):
    """The request's time limit passed before the engine reached it."""


@dataclass
class Run:
    """One request's passage through the engine; its events arrive on `events` as (kind, value):
    ("chunk", StreamChunk), ("error", exception) or ("end", "done" | "cancelled" | "timeout"). `end` is set once
    the consumer has seen the last event ("error" for an exception)."""
    open_stream: Callable[[], Iterator[StreamChunk]]
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which generation stops
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    end: str | None = None
    expired: bool = False  # the time limit passed (cancelled is set too: it stops a stream even mid-prefill)

    def cancel(self):
        self.cancelled.set()

    def expire(self):
        self.expired = True
        self.cancelled.set()

    @property
    def queue_s(self) -> float:
        return (self.started or time.monotonic()) - self.submitted

    def post(self, kind: str, value):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: the server is shutting down
            self.cancel()

    async def chunks(self):
        """The engine's chunks as they come; raises the engine's exception, if any; sets `end`."""
        while True:
            kind, value = await self.events.get()
            if kind == "chunk":
                yield value
            elif kind == "error":
                self.end = "error"
                raise value
            else:
                self.end = value
                return


class Scheduler:
    def __init__(self, max_queue: int, metrics=None, slots: int = 1):
        self.max_queue = max_queue  # requests waiting beyond those generating; more get 429
        self.metrics = metrics
        self.slots = slots
        self.jobs: queue.Queue[Run | None] = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0
        self.busy = 0  # slots generating
        self.service_s = 1.0  # moving average of a request's engine time, for Retry-After
        self.threads: list[threading.Thread] = []

    def start(self):
        self.threads = [threading.Thread(target=self._work, name=f"fastdecode-slot-{i}", daemon=True)
                        for i in range(self.slots)]
        for t in self.threads:
            t.start()

    def stop(self, timeout: float = 5.0):
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join(timeout)

    def submit(self, open_stream: Callable[[], Iterator[StreamChunk]], timeout_s: float,
               cancelled: threading.Event | None = None) -> Run:
        """Queues a request (call on the event loop); raises QueueFull when `max_queue` requests already wait.
        `cancelled`: the event Run.cancel() sets, for a stream that can be told to stop while it waits for a token
        (LLM.stream's `cancel`: a client that leaves mid-prefill)."""
        with self.lock:
            if self.waiting >= self.max_queue + self.slots - self.busy:  # idle slots take one each at once
                raise QueueFull(max(1, math.ceil(self.service_s * (self.waiting + 1) / self.slots)))
            self.waiting += 1
        run = Run(open_stream, asyncio.get_running_loop(), time.monotonic() + timeout_s,
                  cancelled=cancelled or threading.Event())
        self._gauges()
        self.jobs.put(run)
        return run

    def _gauges(self, running: int | None = None):
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.waiting)
            if running is not None:
                self.metrics.running.set(running)

    def _work(self):
        while (run := self.jobs.get()) is not None:
            with self.lock:
                self.waiting -= 1
                self.busy += 1
            run.started = time.monotonic()
            self._gauges(running=self.busy)
            try:
                self._generate(run)
            except Exception as e:  # the request's error (InvalidRequestError) or ours: the handler answers it
                run.post("error", e)
            finally:
                with self.lock:
                    self.busy -= 1
                self._gauges(running=self.busy)
                self.service_s = 0.8 * self.service_s + 0.2 * (time.monotonic() - run.started)

    def _generate(self, run: Run):
        if run.cancelled.is_set():
            return run.post("end", "cancelled")
        if time.monotonic() > run.deadline:
            return run.post("error", QueueTimeout("the request's time limit passed while it waited for the engine"))
        if self.metrics is not None:
            self.metrics.queue_wait.observe(run.queue_s)
        # The limit also ends a prefill, through the same event a client that leaves sets: a stream that has no
        # token yet has no chunk to look at the clock after (a 20k-token prompt at 8B prefills for minutes).
        timer = threading.Timer(max(0.0, run.deadline - time.monotonic()), run.expire)
        timer.daemon = True
        timer.start()
        stream = run.open_stream()
        try:
            for chunk in stream:
                run.post("chunk", chunk)
                if chunk.completion is not None or run.cancelled.is_set():
                    break
        finally:
            timer.cancel()
            stream.close()  # a stream closed early ends the request in the engine
        run.post("end", "timeout" if run.expired else "cancelled" if run.cancelled.is_set() else "done")
