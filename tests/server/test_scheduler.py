"""The FIFO in front of the engine, with plain generators standing in for `LLM.stream`: order, bound, cancel and
time limit."""
import asyncio
import threading
import time

import pytest

from fastdecode.engine.llm import StreamChunk
from fastdecode.server.scheduler import QueueFull, QueueTimeout, Scheduler


def tokens(name: str, n: int, log: list, delay: float = 0.0):
    """A stand-in stream: n chunks, recording when it starts and whether it was closed early."""
    def stream():
        log.append(("start", name))
        try:
            for i in range(n):
                time.sleep(delay)
                yield StreamChunk(f"{name}{i}", [i])
        finally:
            log.append(("closed", name))
    return stream


async def drain(run) -> list[str]:
    return [c.text async for c in run.chunks()]


def scheduled(max_queue=8):
    scheduler = Scheduler(max_queue)
    scheduler.start()
    return scheduler


def test_requests_run_one_at_a_time_in_arrival_order():
    async def main():
        scheduler, log = scheduled(), []
        runs = [scheduler.submit(tokens(name, 3, log, 0.005), 60) for name in "abcd"]
        texts = await asyncio.gather(*(drain(r) for r in runs))
        scheduler.stop()
        return texts, log
    texts, log = asyncio.run(main())
    assert texts == [[f"{n}{i}" for i in range(3)] for n in "abcd"]
    assert log == [(e, n) for n in "abcd" for e in ("start", "closed")]  # never two at once


def test_full_queue_raises_with_a_retry_hint():
    async def main():
        scheduler, log = scheduled(max_queue=1), []
        first = scheduler.submit(tokens("a", 50, log, 0.01), 60)
        await first.events.get()  # a is generating
        second = scheduler.submit(tokens("b", 1, log), 60)
        with pytest.raises(QueueFull) as e:
            scheduler.submit(tokens("c", 1, log), 60)
        first.cancel()
        await drain(first)
        await drain(second)
        scheduler.stop()
        return e.value.retry_after, log
    retry_after, log = asyncio.run(main())
    assert retry_after >= 1 and ("start", "c") not in log


def test_cancel_closes_the_stream_and_skips_a_queued_request():
    async def main():
        scheduler, log = scheduled(), []
        long = scheduler.submit(tokens("long", 1000, log, 0.005), 60)
        queued = scheduler.submit(tokens("queued", 3, log), 60)
        after = scheduler.submit(tokens("after", 2, log), 60)
        await long.events.get()
        queued.cancel()
        long.cancel()
        rest = await drain(long)
        result = await drain(after)
        scheduler.stop()
        return long.end, len(rest), result, log
    end, streamed, result, log = asyncio.run(main())
    assert end == "cancelled" and streamed < 10 and result == ["after0", "after1"]
    assert ("closed", "long") in log and ("start", "queued") not in log


def test_time_limit_ends_generation_and_expires_queued_requests():
    async def main():
        scheduler, log = scheduled(), []
        slow = scheduler.submit(tokens("slow", 1000, log, 0.01), 0.2)
        late = scheduler.submit(tokens("late", 1, log), 0.1)
        await drain(slow)
        with pytest.raises(QueueTimeout):
            await drain(late)
        scheduler.stop()
        return slow.end, log
    end, log = asyncio.run(main())
    assert end == "timeout" and ("closed", "slow") in log and ("start", "late") not in log


def test_time_limit_ends_a_stream_still_waiting_for_its_first_token():
    cancel = threading.Event()

    def prefill():  # as LLM.stream with `cancel`: no chunk until a long prefill ends, or until the event is set
        if cancel.wait(10):
            yield StreamChunk("", [])

    async def main():
        scheduler = scheduled()
        start = time.monotonic()
        run = scheduler.submit(prefill, 0.2, cancel)
        await drain(run)
        scheduler.stop()
        return run.end, time.monotonic() - start
    end, seconds = asyncio.run(main())
    assert end == "timeout" and seconds < 1.5


def test_engine_error_reaches_the_request_and_the_worker_goes_on():
    def broken():
        raise ValueError("bad")
        yield

    async def main():
        scheduler, log = scheduled(), []
        failing = scheduler.submit(broken, 60)
        fine = scheduler.submit(tokens("ok", 1, log), 60)
        with pytest.raises(ValueError):
            await drain(failing)
        result = await drain(fine)
        scheduler.stop()
        return result
    assert asyncio.run(main()) == ["ok0"]


def test_queue_of_zero_still_serves_one_at_a_time():
    async def main():
        scheduler, log = scheduled(max_queue=0), []
        first = scheduler.submit(tokens("a", 50, log, 0.01), 60)
        await first.events.get()
        with pytest.raises(QueueFull):
            scheduler.submit(tokens("b", 1, log), 60)
        first.cancel()
        await drain(first)
        for _ in range(100):  # the worker lets go of the engine
            if not scheduler.busy:
                break
            await asyncio.sleep(0.01)
        result = await drain(scheduler.submit(tokens("c", 1, log), 60))
        scheduler.stop()
        return result
    assert asyncio.run(main()) == ["c0"]
