"""The live dashboard at `/`: one page (static/dashboard.html: inline CSS and script, charts drawn on canvas, nothing
fetched from elsewhere) that polls `GET /dashboard/data` for the last ten minutes of this server.

A Recorder keeps that window: every second a sample of the gauges (requests running and queued, KV-cache tokens in
use), and each finished request's figures (TTFT, prefill and decode tok/s, cached prompt tokens, drafts accepted).
Numbers only: no prompt or output text ever reaches it. The gauges are server-wide, as on /metrics; the requests a
caller sees are its own tenant's, since another tenant's prompt lengths and cache hits are not its business.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from fastdecode.lab.metrics import stats

WINDOW_S = 600
SAMPLE_S = 1.0
MAX_REQUESTS = 5000  # per-request points kept: ten minutes at 8 requests a second
PAGE = Path(__file__).parent / "static" / "dashboard.html"
# The browser itself refuses anything but this server: no CDN, no beacon, and no framing by another site.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                                           "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; "
                                           "frame-ancestors 'none'",
                "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}



@dataclass
class Sample:
    t: float  # unix seconds
    running: int
    queued: int
    kv_used_tokens: int | None  # slots held by live sequences; None without the batching engine
    kv_cached_tokens: int | None  # slots holding cached prefixes nobody uses now (evicted first)


@dataclass
class RequestPoint:
    t: float  # unix seconds at its end
    tenant: str | None
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float  # output tok/s, the first token excluded
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    drafted: int
    accepted: int


class Recorder:
    """The dashboard's window of numbers; `start` samples the gauges on a thread of its own."""

    def __init__(self, llm, scheduler, ceiling: dict | None = None):
        """ceiling: roofline.probe.decode_ceiling's figures for the model (serve measures them at start), or None."""
        self.llm, self.scheduler, self.window_s, self.sample_s = llm, scheduler, WINDOW_S, SAMPLE_S
        self.samples: deque[Sample] = deque(maxlen=int(WINDOW_S / SAMPLE_S) + 1)
        self.requests: deque[RequestPoint] = deque(maxlen=MAX_REQUESTS)
        self.ceiling = ceiling and {"decode_tok_s": round_figure(ceiling["decode_tok_s"]),
                                    "bandwidth_gb_s": round(ceiling["bandwidth_gb_s"], 2),
                                    "weight_bytes_per_token": ceiling["bytes_per_token"]}
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self):
        self.stopping.clear()
        self.thread = threading.Thread(target=self._run, name="fastdecode-dashboard", daemon=True)
        self.thread.start()

    def stop(self):
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(2 * self.sample_s)

    def _run(self):
        while True:
            self.samples.append(self.sample())
            if self.stopping.wait(self.sample_s):
                return

    def sample(self) -> Sample:
        engine = self.llm.engine  # None: a cluster's front (its replicas' engines are elsewhere)
        if engine is None:
            return Sample(time.time(), self.scheduler.busy, self.scheduler.waiting, None, None)
        kv = engine.kv
        return Sample(time.time(), engine.num_running, self.scheduler.waiting + engine.num_waiting,
                      (kv.num_blocks - kv.available) * kv.block_size, len(kv.idle) * kv.block_size)

    def observe(self, completion, tenant: str | None) -> None:
        """One finished generation (the engine's Completion; None when it was cut short: nothing to show)."""
        if completion is None:
            return
        t, spec = completion.timings, completion.speculation or {}
        self.requests.append(RequestPoint(time.time(), tenant, t.ttft_s, t.prefill_tok_s, t.output_tok_s,
                                          t.prompt_tokens, t.cached_tokens, t.output_tokens,
                                          spec.get("drafted", 0), spec.get("accepted", 0)))

    def window(self, tenant: str | None) -> dict:
        """What the page draws: the gauges over the window, the tenant's requests in it, and their summary."""
        now = time.time()
        since = now - self.window_s
        samples = [s for s in list(self.samples) if s.t >= since]
        requests = [r for r in list(self.requests) if r.t >= since and r.tenant == tenant]
        kv = self.llm.engine.kv if self.llm.engine is not None else None
        return {"now": round(now, 3), "window_s": self.window_s, "sample_s": self.sample_s,
                "kv_capacity_tokens": kv.capacity if kv is not None else None,
                "ceiling": self.ceiling,
                "gauges": columns(samples, Sample), "requests": columns(requests, RequestPoint),
                "summary": summary(requests)}


def columns(rows: list, kind: type) -> dict[str, list]:
    """Rows as one list per field but the tenant (the page plots columns): times to 10 ms, other floats to 4
    significant places."""
    names = [f.name for f in fields(kind) if f.name != "tenant"]
    return {n: [round(getattr(r, n), 2) if n == "t" else round_figure(getattr(r, n)) for r in rows] for n in names}


def round_figure(x):
    return float(f"{x:.4g}") if isinstance(x, float) else x


def summary(requests: list[RequestPoint]) -> dict:
    """The window's figures: median TTFT, mean and floor (5th percentile) of decode tok/s, the prefix cache's hit rate
    (cached share of prompt tokens) and speculation's acceptance (None where nothing was drafted)."""
    ttft = stats(r.ttft_s for r in requests)
    decode = stats(r.decode_tok_s for r in requests if r.output_tokens > 1)
    prompt, cached = sum(r.prompt_tokens for r in requests), sum(r.cached_tokens for r in requests)
    drafted, accepted = sum(r.drafted for r in requests), sum(r.accepted for r in requests)
    return {"requests": len(requests), "ttft_s_median": ttft and round_figure(ttft.median),
            "decode_tok_s_mean": decode and round_figure(decode.mean),
            "decode_tok_s_floor": decode and round_figure(decode.p5),
            "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": round_figure(cached / prompt) if prompt else None,
            "drafted": drafted, "accepted": accepted,
            "acceptance": round_figure(accepted / drafted) if drafted else None}


def dashboard_routes(recorder: Recorder) -> APIRouter:
    """`/` (the page: no key needed, it holds no data) and `/dashboard/data` (behind the key, as /v1/* is)."""
    router = APIRouter()
    page = PAGE.read_text()

    @router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # Claude Code sends HEAD / first
    async def dashboard():
        return HTMLResponse(page, headers=PAGE_HEADERS)

    @router.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(request: Request):
        return recorder.window(getattr(request.state, "tenant", None))

    return router
