"""Requests in front of the engine, on the event loop: at most `slots` of them streaming from it at once (the engine
batches them, so `slots` is its batch size), the rest waiting in arrival order, at most `max_queue` of them (more get
429).

No thread waits on a request: a request is read through `LLM.astream`, whose chunks the engine's thread hands to the
event loop as it posts them. A request whose client went away, or whose time ran out, leaves the queue or has its
stream closed, which ends it in the engine at its next step, even mid-prefill. When the server stops (`close`), every
request ends at once, waiting or generating, and new ones are refused.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastdecode.engine.llm import StreamChunk


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: {retry_after} s")
        self.retry_after = retry_after


class QueueTimeout(Exception):
    """The request's time limit passed before the engine reached it."""


class ShuttingDown(Exception):
    """The server is stopping."""


@dataclass(eq=False)
class Run:
    """One request's passage through the engine. `open_stream()` -> its chunks (an async iterator with `close()`),
    opened once a slot is free. `end`: "done", "cancelled", "timeout", "shutdown" or "error", set once `chunks()` has
    ended."""
    open_stream: Callable[[], AsyncIterator[StreamChunk]]
    scheduler: Scheduler
    deadline: float  # time.monotonic() after which generation stops
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    end: str | None = None
    stream: AsyncIterator[StreamChunk] | None = None
    cancelled: bool = False
    expired: bool = False  # the time limit passed
    shut: bool = False  # the server is stopping
    timer: asyncio.TimerHandle | None = None
    queued: bool = True  # counted in the scheduler's waiting
    holding: bool = False  # holds one of the scheduler's slots

    @property
    def queue_s(self) -> float:
        return (self.started or time.monotonic()) - self.submitted

    def cancel(self):
        """Stops the request wherever it is: waiting (it never starts) or streaming (its stream is closed)."""
        self.cancelled = True
        self._stop()

    def _expire(self):
        self.expired = True
        self._stop()

    def shut_down(self):
        self.shut = True
        self.cancel()

    def _stop(self):
        if self.stream is not None:
            self.stream.close()
        self.scheduler.give_back(self)  # its place in the queue, or its slot, for the next request at once

    async def chunks(self):
        """The engine's chunks as they come; raises the engine's exception, or QueueTimeout when the time limit
        passes before a slot is free; sets `end`."""
        try:
            await self.scheduler.take_slot(self)
            if self.cancelled:
                self.end = "shutdown" if self.shut else "cancelled"
                return
            self.stream = self.open_stream()
            # The limit also ends a prefill, through the stream's close: a stream with no token yet has no chunk to
            # look at the clock after (a 20k-token prompt at 8B prefills for minutes).
            self.timer = asyncio.get_running_loop().call_later(max(0.0, self.deadline - time.monotonic()),
                                                                self._expire)
            async for chunk in self.stream:
                if self.expired or self.cancelled:
                    break
                yield chunk
                if chunk.completion is not None:
                    break
            self.end = ("shutdown" if self.shut else "timeout" if self.expired else "cancelled" if self.cancelled
                        else "done")
        except Exception:  # (not a reader that was cancelled or closed: `end` stays None for it)
            self.end = "error"
            raise
        finally:
            if self.timer is not None:
                self.timer.cancel()
            if self.stream is not None:
                self.stream.close()  # a stream closed early ends the request in the engine
            self.scheduler.give_back(self)


class Scheduler:
    def __init__(self, max_queue: int, metrics=None, slots: int = 1):
        self.max_queue = max_queue  # requests waiting beyond those generating; more get 429
        self.metrics = metrics
        self.slots = slots
        self.waiting = 0
        self.busy = 0  # slots generating
        self.free: asyncio.Semaphore | None = None  # made on the event loop, at the first request
        self.service_s = 1.0  # moving average of a request's engine time, for Retry-After
        self.runs: set[Run] = set()  # submitted and not given back
        self.closing = False

    def submit(self, open_stream: Callable[[], AsyncIterator[StreamChunk]], timeout_s: float) -> Run:
        """Queues a request (call on the event loop); raises QueueFull when `max_queue` requests already wait, and
        ShuttingDown once the server is stopping."""
        if self.closing:
            raise ShuttingDown()
        if self.waiting >= self.max_queue + self.slots - self.busy:  # idle slots take one each at once
            raise QueueFull(max(1, math.ceil(self.service_s * (self.waiting + 1) / self.slots)))
        self.waiting += 1
        self._gauges()
        run = Run(open_stream, self, time.monotonic() + timeout_s)
        self.runs.add(run)
        return run

    def close(self):
        """The server is stopping (call on the event loop): every request ends now, waiting or generating, rather
        than when the server's grace period runs out and its tasks are cancelled (500s, a traceback each)."""
        self.closing = True
        for run in list(self.runs):  # (the slots the generating ones give back wake the waiting ones, in turn)
            run.shut_down()

    async def take_slot(self, run: Run):
        if self.free is None:
            self.free = asyncio.Semaphore(self.slots)
        if run.cancelled:
            return
        try:
            async with asyncio.timeout(max(0.0, run.deadline - time.monotonic())):
                await self.free.acquire()
        except TimeoutError:
            raise QueueTimeout("the request's time limit passed while it waited for the engine") from None
        finally:
            self.leave_queue(run)
        if run.cancelled:  # while the slot was being handed to it
            self.free.release()
            return
        run.started, run.holding = time.monotonic(), True
        self.busy += 1
        if self.metrics is not None:
            self.metrics.queue_wait.observe(run.queue_s)
        self._gauges(running=self.busy)

    def leave_queue(self, run: Run):
        if run.queued:
            run.queued = False
            self.waiting -= 1
            self._gauges()

    def give_back(self, run: Run):
        """The run is over: out of the queue, and its slot (if it held one) free for the next."""
        self.runs.discard(run)
        self.leave_queue(run)
        if run.holding:
            run.holding = False
            self.busy -= 1
            self.free.release()
            self._gauges(running=self.busy)
            self.service_s = 0.8 * self.service_s + 0.2 * (time.monotonic() - run.started)

    def _gauges(self, running: int | None = None):
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.waiting)
            if running is not None:
                self.metrics.running.set(running)
