"""One streamed chat completion against any OpenAI-compatible endpoint, with a timestamp per SSE chunk.

A request that fails during a run becomes a record with `error` set (kept, counted, shown); only the check before
a run (`check_endpoint`) raises, so that an unreachable endpoint, a refused key or a server that does not stream
stops the lab with one clear line instead of a table of failures.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from fastdecode.errors import FastdecodeError
from fastdecode.lab.records import Chunk, RequestRecord


class EndpointError(FastdecodeError):
    """The endpoint answered, but not as an OpenAI-compatible streaming chat endpoint."""


class EndpointUnreachableError(EndpointError):
    """Nothing listens at the endpoint's address (or DNS, TLS, a proxy failed)."""


class AuthRefusedError(EndpointError):
    """The endpoint refused the API key (HTTP 401 or 403)."""


class NotStreamingError(EndpointError):
    """The endpoint answered a streaming request with something other than server-sent events."""


@dataclass
class Endpoint:
    url: str  # the chat completions URL
    model: str  # the `model` field of each request
    api_key: str | None = None
    label: str = ""

    @classmethod
    def from_base(cls, base: str, model: str, api_key: str | None = None, label: str = "") -> Endpoint:
        """`base` may be the server root, its /v1, or the full chat completions URL."""
        url = base.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise EndpointError(f"endpoint {base!r} is not an http(s) URL")
        if not url.endswith("/chat/completions"):
            url += "/chat/completions" if url.endswith("/v1") else "/v1/chat/completions"
        return cls(url, model, api_key, label or base)

    def headers(self) -> dict:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def payload(endpoint: Endpoint, messages: list[dict], max_tokens: int, sampling: dict) -> dict:
    return {"model": endpoint.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}


class SSEDecoder:
    """Server-sent events, line by line: `data:` lines gather until a blank line ends the event."""

    def __init__(self):
        self.data: list[str] = []

    def feed(self, line: str) -> str | None:
        if not line:
            return self.flush()
        if line.startswith(":"):  # a comment, used as a keep-alive ping
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self.data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        data, self.data = self.data, []
        return "\n".join(data) if data else None


async def stream_chat(client: httpx.AsyncClient, endpoint: Endpoint, body: dict, record: RequestRecord,
                      timeout_s: float) -> RequestRecord:
    """Send `body`, fill `record` with the stream's chunks (times from sending), usage and end time, or its error."""
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, endpoint, body, record, t0), timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        record.error = f"timeout: no complete answer within {timeout_s:g} s"
    except httpx.TransportError as e:
        record.error = f"connection: {type(e).__name__}: {e}"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        record.error = f"bad stream: {e}"
    record.end_s = time.perf_counter() - t0
    if record.error is None and not record.chunks:
        record.error = "empty: the stream carried no tokens"
    return record


async def _stream(client, endpoint, body, record, t0):
    async with client.stream("POST", endpoint.url, json=body, headers=endpoint.headers()) as response:
        record.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            record.error = f"http {response.status_code}: {error_message(text)}"
            return
        if "text/event-stream" not in response.headers.get("content-type", ""):
            text = (await response.aread()).decode("utf-8", "replace")
            record.error = f"not streaming: content-type {response.headers.get('content-type')!r}: {text[:200]}"
            return
        decoder = SSEDecoder()
        async for line in response.aiter_lines():
            t = time.perf_counter() - t0
            data = decoder.feed(line.rstrip("\r"))
            if data is not None and handle_event(data, t, record):
                return
        data = decoder.flush()  # a stream closed without a final blank line
        if data is not None:
            handle_event(data, time.perf_counter() - t0, record)


def handle_event(data: str, t: float, record: RequestRecord) -> bool:
    """Add one SSE event's tokens to `record`; True at [DONE]."""
    if data.strip() == "[DONE]":
        return True
    event = json.loads(data)
    if event.get("error"):
        record.error = f"server: {error_message(json.dumps(event))}"
        return True
    if event.get("usage"):
        record.usage = event["usage"]
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content") or ""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
        if content or reasoning:
            record.chunks.append(Chunk(t, content, reasoning))
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    return False


def error_message(text: str) -> str:
    """The message of an OpenAI error object, or the start of the body."""
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        message = err.get("message") if isinstance(err, dict) else err
        return str(message or text)[:300]
    except (json.JSONDecodeError, AttributeError):
        return " ".join(text.split())[:300] or "(empty body)"


async def check_endpoint(endpoint: Endpoint, timeout_s: float = 60.0) -> RequestRecord:
    """One short streamed request before a run; raises a one-line error for the failures that would make every
    request of the run fail the same way."""
    record = RequestRecord(item_id="check", category="check", phase="check")
    body = payload(endpoint, [{"role": "user", "content": "Say hello."}], 4, {"temperature": 0})
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        await stream_chat(client, endpoint, body, record, timeout_s)
    err = record.error or ""
    if err.startswith("connection"):
        raise EndpointUnreachableError(f"cannot reach {endpoint.url} ({err.split(': ', 1)[1]})")
    if record.status in (401, 403):
        raise AuthRefusedError(f"{endpoint.url} refused the API key (HTTP {record.status}: "
                               f"{err.split(': ', 1)[-1]}); check --api-key-env")
    if err.startswith("not streaming"):
        raise NotStreamingError(f"{endpoint.url} does not stream: it answered stream=true with "
                                f"{err.split(': ', 2)[1]}, not server-sent events")
    if err:
        raise EndpointError(f"{endpoint.url}: {err}")
    return record
