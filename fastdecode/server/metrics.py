"""Prometheus metrics, one registry per server (no module-global state), and the ASGI middleware that counts
requests by route and status."""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOK_S = (1, 5, 10, 20, 30, 40, 50, 60, 80, 100, 150, 200, 400)
SHARE = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json", "/",
          "/dashboard/data")


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("fastdecode_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.errors = Counter("fastdecode_request_errors", "Requests answered with an error, by status",
                              ["route", "status"], registry=r)
        self.cancelled = Counter("fastdecode_requests_cancelled", "Generations ended early: client gone or timed out",
                                 ["reason"], registry=r)
        self.ttft = Histogram("fastdecode_ttft_seconds", "Time to first token (engine: prefill and first sample)",
                              buckets=SECONDS, registry=r)
        self.queue_wait = Histogram("fastdecode_queue_wait_seconds", "Time a request waited for the engine",
                                    buckets=SECONDS, registry=r)
        self.output_tok_s = Histogram("fastdecode_output_tokens_per_second", "Decode speed per request, first token "
                                      "excluded", buckets=TOK_S, registry=r)
        self.acceptance = Histogram("fastdecode_speculation_acceptance_rate", "Share of drafted tokens accepted, per "
                                    "request", buckets=SHARE, registry=r)
        self.drafted = Counter("fastdecode_speculation_drafted_tokens", "Tokens the drafter proposed", registry=r)
        self.accepted = Counter("fastdecode_speculation_accepted_tokens", "Drafted tokens the verifier accepted",
                                registry=r)
        self.prompt_tokens = Counter("fastdecode_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_tokens = Counter("fastdecode_prompt_tokens_cached", "Prompt tokens found in the prefix cache "
                                     "(their share of fastdecode_prompt_tokens is the hit rate)", registry=r)
        self.disk_cached_tokens = Counter("fastdecode_prompt_tokens_cached_disk", "Of the cached prompt tokens, those "
                                          "read from the prefix cache's disk tier", registry=r)
        self.completion_tokens = Counter("fastdecode_completion_tokens", "Output tokens generated", registry=r)
        self.queue_depth = Gauge("fastdecode_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("fastdecode_requests_running", "Requests the engine is generating", registry=r)

    def observe_completion(self, prompt_tokens: int, output_tokens: int, completion) -> None:
        """One finished generation; `completion` is the engine's Completion, or None if it was cut short."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(output_tokens)
        if completion is None:
            return
        t = completion.timings
        self.cached_tokens.inc(t.cached_tokens)
        self.disk_cached_tokens.inc(t.disk_cached_tokens)
        self.ttft.observe(t.ttft_s)
        if t.output_tokens > 1:
            self.output_tok_s.observe(t.output_tok_s)
        spec = completion.speculation or {}
        if spec.get("drafted"):
            self.drafted.inc(spec["drafted"])
            self.accepted.inc(spec.get("accepted", 0))
            self.acceptance.observe(spec.get("acceptance_rate", spec.get("accepted", 0) / spec["drafted"]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware: every answered request by route and status (unknown paths share one label)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"
        status = {}

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            code = str(status.get("code", 500))
            self.metrics.requests.labels(route, code).inc()
            if int(code) >= 400:
                self.metrics.errors.labels(route, code).inc()
