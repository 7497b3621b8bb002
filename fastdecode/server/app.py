"""The HTTP application: OpenAI's chat and text completion endpoints, models, health and metrics, over one engine.

A request is checked and tokenized (prepare), takes its place in the FIFO (scheduler), and once its first token
exists is answered as one JSON object or as Server-Sent Events (protocol). Until then no byte has gone out, so
errors keep their HTTP status; a client that leaves at any point frees the engine.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from fastdecode.engine.progress import PrefillLog
from fastdecode.errors import EngineUnavailable, FastdecodeError
from fastdecode.server.anthropic.routes import messages_routes
from fastdecode.server.config import ServerConfig
from fastdecode.server.dashboard import Recorder, dashboard_routes
from fastdecode.server.errors import ApiError, install_error_handlers, stream_failure
from fastdecode.server.limits import BodyLimit
from fastdecode.server.metrics import CountRequests, Metrics
from fastdecode.server.prepare import EngineRequest, ServedModel, chat_request, completion_request
from fastdecode.server.protocol import ChatFormatter, TextFormatter
from fastdecode.server.responses.routes import responses_routes
from fastdecode.server.scheduler import QueueFull, QueueTimeout, Run, Scheduler, ShuttingDown
from fastdecode.server.schemas import ChatCompletionRequest, CompletionRequest
from fastdecode.server.security import Guard

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PENDING = object()  # a stream's first chunk, not yet come

log = logging.getLogger(__name__)


class ClientGone(Exception):
    pass


def create_app(llm, config: ServerConfig | None = None, ceiling: dict | None = None) -> FastAPI:
    """ceiling: the model's decode roofline on this machine (roofline.probe.decode_ceiling), for the dashboard."""
    config = config or ServerConfig()
    served = ServedModel(llm, config.served_model_name)
    metrics = Metrics()
    # The engine batches every open stream (a cluster's replicas each a batch).
    scheduler = Scheduler(config.max_queue, metrics, slots=llm.slots)
    recorder = Recorder(llm, scheduler, ceiling)  # the dashboard's last minutes
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        recorder.start()
        yield
        recorder.stop()

    app = FastAPI(title="fastdecode", summary="OpenAI-compatible API over one fastdecode engine",
                  version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, max_values=config.max_body_values)
    app.add_middleware(Guard, config=config)  # outside BodyLimit: no key, no body read; inside the request count
    app.add_middleware(CountRequests, metrics=metrics)
    app.state.scheduler, app.state.metrics, app.state.served = scheduler, metrics, served

    def model_card() -> dict:
        return {"id": served.id, "object": "model", "created": started, "owned_by": "fastdecode",
                "max_model_len": llm.max_seq_len}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.id, "queue_depth": scheduler.waiting, **llm.status()}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str):
        served.check_model(model)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        served.check_model(body.model)
        job = await run_in_threadpool(chat_request, body, served)
        log.info("chat: %d messages, %d tools, %d prompt tokens, max_tokens %d%s", len(body.messages),
                 len(body.tools or []), len(job.prompt_ids), job.params.max_tokens, ", streamed" if body.stream else "")
        fmt = ChatFormatter(served.id, llm.tokenizer, len(job.prompt_ids), job.params.logprobs is not None,
                            include_usage(body), reply=job.reply)
        return await answer(request, job, fmt, bool(body.stream))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        served.check_model(body.model)
        job = await run_in_threadpool(completion_request, body, served)
        fmt = TextFormatter(served.id, llm.tokenizer, len(job.prompt_ids), job.params.logprobs is not None,
                            include_usage(body), echo=job.echo)
        return await answer(request, job, fmt, bool(body.stream))

    async def answer(request: Request, job: EngineRequest, fmt, stream: bool):
        fmt.expose_speculation = config.expose_speculation_stats
        try:
            # Drafters remember earlier requests only within a tenant (the holders of one API key; with no key
            # configured nobody: each request its own), and cached prefixes are shared only within one too.
            tenant = getattr(request.state, "tenant", None)
            salt = cache_salt(tenant, job.cache_salt, config.share_prefix_cache)
            args = (job.prompt_ids, job.params, job.logits_processor)
            kw = dict(salt=salt, tenant=tenant, on_prefill=PrefillLog(log))
            # Read straight from the engine (or a cluster's replica) on this event loop.
            session = request.headers.get("x-session-affinity") or \
                request.headers.get("x-claude-code-session-id") or job.session  # opencode's, Claude Code's
            run = scheduler.submit(lambda: llm.astream(*args, session=session, **kw), config.request_timeout_s)
        except QueueFull as e:
            raise ApiError(429, f"The server is busy: {scheduler.waiting} requests are waiting for the engine. "
                                f"Retry after {e.retry_after} s.", code="queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except ShuttingDown:
            raise shutting_down() from None
        chunks = run.chunks()
        handed_off = False
        try:
            if stream and fmt.early_start:  # Messages, Responses: headers and keep-alives before the first token
                first = PENDING
            else:
                first = await until_disconnected(request, anext(chunks, None))
            if run.end == "shutdown":
                raise shutting_down()
            if stream:
                handed_off = True
                return StreamingResponse(events(run, fmt, first, chunks, tenant), media_type="text/event-stream",
                                         headers=SSE_HEADERS)
            completion = await until_disconnected(request, collect(fmt, first, chunks))
            if run.end == "shutdown":
                raise shutting_down()
            return JSONResponse(fmt.response(completion, run.end, run.queue_s))
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except QueueTimeout as e:
            raise ApiError(503, str(e), code="timeout", headers={"Retry-After": "1"}) from None
        except EngineUnavailable as e:
            raise ApiError(503, str(e), code="engine_unavailable", headers={"Retry-After": "1"}) from None
        except FastdecodeError as e:
            raise ApiError(400, str(e)) from None
        finally:
            if not handed_off:
                finished(run, fmt, tenant)

    async def collect(fmt, first, chunks):
        """Feeds every chunk to the formatter; returns the engine's Completion (None if generation was cut)."""
        chunk = first
        while chunk is not None:
            fmt.add(chunk)
            fmt.completion = chunk.completion or fmt.completion
            chunk = await anext(chunks, None)
        return fmt.completion

    async def events(run: Run, fmt, first, chunks, tenant: str | None):
        """`first` is PENDING for a stream started before its first token: keep-alive events until it comes."""
        waiting = None
        try:
            for c in fmt.start():
                yield fmt.sse(c)
            chunk = first
            if chunk is PENDING:
                waiting = asyncio.ensure_future(anext(chunks, None))
                while not (await asyncio.wait({waiting}, timeout=config.keepalive_s))[0]:
                    yield fmt.sse(fmt.keepalive())
                chunk = waiting.result()
            while chunk is not None:
                for c in fmt.add(chunk):
                    yield fmt.sse(c)
                fmt.completion = chunk.completion or fmt.completion
                chunk = await anext(chunks, None)
            if run.end == "shutdown":
                yield fmt.sse_error(503, SHUTTING_DOWN)
                return
            for c in fmt.finish(fmt.completion, run.end, run.queue_s):
                yield fmt.sse(c)
            for c in fmt.sse_end():
                yield c
        except Exception as e:  # the engine failed mid-stream; the SDKs raise on an error event
            yield fmt.sse_error(*((503, str(e)) if isinstance(e, QueueTimeout) else stream_failure(e, fmt.id)))
        finally:
            if waiting is not None and not waiting.done():
                waiting.cancel()
            finished(run, fmt, tenant)

    def finished(run: Run, fmt, tenant: str | None):
        """Books a request that is over, however it ended; a run still going (its client left) is stopped."""
        if run.end is None:
            run.cancel()
            metrics.cancelled.labels("client").inc()
        elif run.end == "timeout":
            metrics.cancelled.labels("timeout").inc()
        if run.started is not None and run.end != "error":
            metrics.observe_completion(fmt.prompt_tokens, fmt.tokens, fmt.completion)
            recorder.observe(fmt.completion, tenant)

    async def until_disconnected(request: Request, awaitable):
        """Awaits `awaitable` unless the client disconnects first (polled: no bytes have gone out yet)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=config.disconnect_poll_s)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()

    app.include_router(messages_routes(served, answer))  # Anthropic's Messages API
    app.include_router(responses_routes(served, answer))  # OpenAI's Responses API, stateless
    app.include_router(dashboard_routes(recorder))  # the live dashboard at /
    return app


SHUTTING_DOWN = "the server is shutting down: retry against it once it is back"


def shutting_down() -> ApiError:
    return ApiError(503, SHUTTING_DOWN, code="shutting_down", headers={"Retry-After": "5"})


def cache_salt(tenant: str | None, salt: str | None, shared: bool = False) -> str:
    """The prefix-cache namespace of a request: its tenant's (unless tenants share one) and, within it, the
    request's own `cache_salt`. No key configured: one tenant, the namespace of `fastdecode chat` and the Python API."""
    parts = [] if shared or tenant is None else [f"tenant:{tenant}"]
    return "\0".join(parts + ([f"salt:{salt}"] if salt else []))


def include_usage(body) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)
