"""The FIFO in front of the engine, with stand-in streams in LLM.astream's form (async iterators with close()): order,
bound, cancel and time limit."""
import asyncio
import time

import pytest

from fastdecode.engine.llm import StreamChunk
from fastdecode.server.scheduler import QueueFull, QueueTimeout, Scheduler, ShuttingDown


class Stream:
    """n chunks, `delay` apart; records when it starts and when it is closed. With `until_closed`, no chunk comes
    until close() (as a prompt prefilling for minutes: the engine ends it at close and the reader wakes)."""

    def __init__(self, name: str, n: int, log: list, delay: float = 0.0, until_closed: bool = False):
        self.name, self.n, self.log, self.delay, self.i = name, n, log, delay, 0
        self.closed = asyncio.Event()
        self.until_closed = until_closed
        log.append(("start", name))

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.until_closed:
            await self.closed.wait()
        if self.closed.is_set() or self.i == self.n:
            raise StopAsyncIteration
        await asyncio.sleep(self.delay)
        self.i += 1
        return StreamChunk(f"{self.name}{self.i - 1}", [self.i])

    def close(self):
        if not self.closed.is_set():
            self.closed.set()
            self.log.append(("closed", self.name))


def tokens(name: str, n: int, log: list, delay: float = 0.0, **kw):
    return lambda: Stream(name, n, log, delay, **kw)


async def drain(run) -> list[str]:
    return [c.text async for c in run.chunks()]


def test_requests_run_one_at_a_time_in_arrival_order():
    async def main():
        scheduler, log = Scheduler(8), []
        runs = [scheduler.submit(tokens(name, 3, log, 0.005), 60) for name in "abcd"]
        texts = await asyncio.gather(*(drain(r) for r in runs))
        return texts, log, [r.end for r in runs]
    texts, log, ends = asyncio.run(main())
    assert texts == [[f"{n}{i}" for i in range(3)] for n in "abcd"] and ends == ["done"] * 4
    assert log == [(e, n) for n in "abcd" for e in ("start", "closed")]  # never two at once


def test_slots_stream_side_by_side_and_the_rest_wait():
    async def main():
        scheduler, log = Scheduler(8, slots=2), []
        runs = [scheduler.submit(tokens(name, 3, log, 0.01), 60) for name in "abc"]
        await asyncio.gather(*(drain(r) for r in runs))
        return log
    log = asyncio.run(main())
    assert log[:2] == [("start", "a"), ("start", "b")] and log.index(("start", "c")) > 2


def test_full_queue_raises_with_a_retry_hint():
    async def main():
        scheduler, log = Scheduler(1), []
        first = scheduler.submit(tokens("a", 50, log, 0.01), 60)
        chunks = first.chunks()
        await anext(chunks)  # a is generating
        second = scheduler.submit(tokens("b", 1, log), 60)
        with pytest.raises(QueueFull) as e:
            scheduler.submit(tokens("c", 1, log), 60)
        first.cancel()
        assert [c async for c in chunks] == []
        await drain(second)
        return e.value.retry_after, log, (scheduler.waiting, scheduler.busy)
    retry_after, log, counts = asyncio.run(main())
    assert retry_after >= 1 and ("start", "c") not in log and counts == (0, 0)


def test_cancel_closes_the_stream_and_skips_a_queued_request():
    async def main():
        scheduler, log = Scheduler(8), []
        long = scheduler.submit(tokens("long", 1000, log, 0.005), 60)
        queued = scheduler.submit(tokens("queued", 3, log), 60)
        after = scheduler.submit(tokens("after", 2, log), 60)
        chunks = long.chunks()
        await anext(chunks)
        queued.cancel()
        long.cancel()
        rest = [c async for c in chunks]
        waiting = asyncio.gather(drain(queued), drain(after))
        skipped, result = await waiting
        return long.end, queued.end, len(rest), skipped, result, log
    end, queued_end, streamed, skipped, result, log = asyncio.run(main())
    assert end == "cancelled" and queued_end == "cancelled" and streamed == 0 and skipped == []
    assert result == ["after0", "after1"] and ("closed", "long") in log and ("start", "queued") not in log


def test_close_ends_every_request_at_once_and_refuses_new_ones():
    async def main():
        scheduler, log = Scheduler(8, slots=2), []
        runs = [scheduler.submit(tokens(name, 1000, log, 0.01), 600) for name in "abcd"]  # a, b generate; c, d wait
        readers = [asyncio.ensure_future(drain(r)) for r in runs]
        await asyncio.sleep(0.05)
        started = time.monotonic()
        scheduler.close()
        texts = await asyncio.wait_for(asyncio.gather(*readers), 5)
        with pytest.raises(ShuttingDown):
            scheduler.submit(tokens("e", 1, log), 60)
        return time.monotonic() - started, texts, [r.end for r in runs], (scheduler.waiting, scheduler.busy), log
    seconds, texts, ends, counts, log = asyncio.run(main())
    assert seconds < 1 and ends == ["shutdown"] * 4 and counts == (0, 0)
    assert texts[2:] == [[], []] and 0 < len(texts[0]) < 1000
    assert ("closed", "a") in log and ("start", "c") not in log and ("start", "e") not in log


def test_a_reader_that_is_cancelled_frees_its_slot_at_once():
    async def main():
        scheduler, log = Scheduler(8), []
        reader = asyncio.ensure_future(drain(scheduler.submit(tokens("gone", 1000, log, 0.01), 60)))
        await asyncio.sleep(0.05)
        reader.cancel()  # the client left: the app's task awaiting the chunks is cancelled
        with pytest.raises(asyncio.CancelledError):
            await reader
        busy = scheduler.busy
        return busy, await drain(scheduler.submit(tokens("next", 1, log), 60)), log
    busy, result, log = asyncio.run(main())
    assert busy == 0 and result == ["next0"] and ("closed", "gone") in log


def test_time_limit_ends_generation_and_expires_queued_requests():
    async def main():
        scheduler, log = Scheduler(8), []
        slow = scheduler.submit(tokens("slow", 1000, log, 0.01), 0.2)
        late = scheduler.submit(tokens("late", 1, log), 0.1)
        results = await asyncio.gather(drain(slow), drain(late), return_exceptions=True)
        return slow.end, results[1], log
    end, late, log = asyncio.run(main())
    assert end == "timeout" and isinstance(late, QueueTimeout)
    assert ("closed", "slow") in log and ("start", "late") not in log


def test_time_limit_ends_a_stream_still_waiting_for_its_first_token():
    async def main():
        scheduler, log = Scheduler(8), []
        start = time.monotonic()
        run = scheduler.submit(tokens("prefill", 1, log, until_closed=True), 0.2)
        texts = await drain(run)
        return run.end, texts, time.monotonic() - start
    end, texts, seconds = asyncio.run(main())
    assert end == "timeout" and texts == [] and seconds < 1.5


def test_engine_error_reaches_the_request_and_the_next_goes_on():
    class Broken(Stream):
        async def __anext__(self):
            raise ValueError("bad")

    async def main():
        scheduler, log = Scheduler(8), []
        failing = scheduler.submit(lambda: Broken("broken", 1, log), 60)
        fine = scheduler.submit(tokens("ok", 1, log), 60)
        with pytest.raises(ValueError):
            await drain(failing)
        return failing.end, await drain(fine), ("closed", "broken") in log
    assert asyncio.run(main()) == ("error", ["ok0"], True)


def test_queue_of_zero_still_serves_one_at_a_time():
    async def main():
        scheduler, log = Scheduler(0), []
        first = scheduler.submit(tokens("a", 50, log, 0.01), 60)
        chunks = first.chunks()
        await anext(chunks)
        with pytest.raises(QueueFull):
            scheduler.submit(tokens("b", 1, log), 60)
        first.cancel()
        await chunks.aclose()
        return await drain(scheduler.submit(tokens("c", 1, log), 60))
    assert asyncio.run(main()) == ["c0"]
