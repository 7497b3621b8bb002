"""A long prefill's progress (tokens done of the prompt's, rate, time left): the line `generate` and `chat` show
while it runs and the lines `serve` logs. Both take `LLM.stream`'s on_prefill(done, total) calls."""
from __future__ import annotations

import time


class PrefillProgress:
    """Rate from the first report on (what a prompt's cached prefix gave at once is not prefill speed)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first: tuple[float, int] | None = None

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def describe(self, done: int, total: int) -> str:
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, done)
        t0, done0 = self.first
        text = f"prefill {done:,}/{total:,} tokens ({100 * done / max(total, 1):.0f}%)"
        if now > t0 and done > done0:
            rate = (done - done0) / (now - t0)
            text += f", {rate:,.0f} tok/s, {(total - done) / rate:,.0f} s left"
        return text


class PrefillLine(PrefillProgress):
    """A transient line on a rich console once a prefill has run `after_s`; gone at the first token."""

    def __init__(self, console, after_s: float = 1.0):
        super().__init__()
        self.console, self.after_s, self.status = console, after_s, None

    def __call__(self, done: int, total: int):
        if done >= total:
            if self.status is not None:
                self.status.stop()
            return
        text = self.describe(done, total)
        if self.elapsed_s < self.after_s:
            return
        if self.status is None:
            self.status = self.console.status(text)
            self.status.start()
        else:
            self.status.update(text)


class PrefillLog(PrefillProgress):
    """A log line every `every_s` of a prefill, and one at its end when any was written."""

    def __init__(self, log, every_s: float = 10.0):
        super().__init__()
        self.log, self.every_s, self.logged = log, every_s, 0

    def __call__(self, done: int, total: int):
        if done >= total:
            if self.logged:
                self.log.info("prefilled %d tokens in %.1f s", total, self.elapsed_s)
            return
        text = self.describe(done, total)
        if self.elapsed_s >= self.every_s * (self.logged + 1):
            self.logged += 1
            self.log.info("%s", text)
