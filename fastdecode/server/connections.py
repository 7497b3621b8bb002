"""Connections: how many may be open, and how long a client may take to send its request.

uvicorn waits for a request's bytes as long as the client holds the socket: 300 connections that sent half a request
and then nothing stayed open until their clients left, the process ran out of file descriptors, `/health` timed out,
and asyncio logged every failed accept() with its traceback (991k of them, 420 MB in 100 s: Python 3.11's accept loop
goes on through its whole backlog after the first EMFILE). So here:
- a request's headers must arrive within `header_timeout_s` of the connection opening (or of the response before it,
  on a kept-alive connection) and its body within `body_timeout_s` of the headers; past either the client gets 408
  (if it began a request) and the connection is closed;
- at most `max_connections` are open, fewer if the open-files limit would not hold them. A connection beyond closes
  the one that has waited longest for a request's headers (a client that is slow to speak, or an idle kept-alive
  one), so that a stuck client never keeps out a new one; only when every connection is inside a request is the new
  one answered 503;
- asyncio's accept errors, and the connections closed for taking too long, are logged at most once every 10 s.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from fastdecode.server.errors import error_body, error_body_for

log = logging.getLogger(__name__)
SPARE_FILES = 32  # descriptors beside the connections and their bursts: the KV disk tier's files, logs
TIMED_OUT = "closed a connection"
ACCEPT_ERRORS = ("socket.accept() out of system resource", "Exception in callback BaseSelectorEventLoop._start_serving")


@dataclass
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    # asyncio accepts up to this many connections at a time, before any is looked at (and a closed one's descriptor
    # is freed a loop turn later): it is also the listen queue, where the kernel holds the ones not yet accepted.
    backlog: int = 2048
    # Connections waiting for a request's headers, the longest waiting first: the ones to close to make room.
    waiting: dict[GuardedH11Protocol, None] = field(default_factory=dict)

    def make_room(self) -> bool:
        """Closes the connection that has waited longest for a request's headers; False if none is waiting."""
        if not self.waiting:
            return False
        oldest = next(iter(self.waiting))
        self.waiting.pop(oldest)
        oldest.transport.close()
        return True


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under `limits`, one per connection. h11's view of the client (`their_state`) says what
    is being read: IDLE, a request's headers; SEND_BODY, its body; anything else, nothing (the request is in, or the
    connection is ending). A refused connection is answered and closed without joining uvicorn's."""

    def __init__(self, *args, limits: ConnectionLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.reading: str | None = None  # "headers" or "body": what the deadline is for
        self.deadline = None  # the loop's TimerHandle for it
        self.refused = False

    def connection_made(self, transport):
        if len(self.connections) >= self.limits.max_connections and not self.limits.make_room():
            self.refused, self.transport = True, transport
            transport.write(raw_response(503, "Service Unavailable", error_body(
                503, f"the server has {self.limits.max_connections} connections open, each inside a request: retry "
                     "shortly", code="too_many_connections"), b"retry-after: 1\r\n"))
            transport.close()
            return
        super().connection_made(transport)
        self.track()

    def data_received(self, data: bytes):
        if self.refused:
            return
        super().data_received(data)
        self.track()

    def on_response_complete(self):
        super().on_response_complete()
        self.track()

    def connection_lost(self, exc):
        if self.refused:
            return
        self.limits.waiting.pop(self, None)
        if self.deadline is not None:
            self.deadline.cancel()
        super().connection_lost(exc)

    def track(self):
        """Starts the deadline for what is now being read, if that changed."""
        state = self.conn.their_state
        reading = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if reading == self.reading or self.transport.is_closing():
            return
        self.reading = reading
        self.limits.waiting.pop(self, None)
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        if reading == "headers":
            self.limits.waiting[self] = None
        if reading is not None:
            seconds = self.limits.header_timeout_s if reading == "headers" else self.limits.body_timeout_s
            self.deadline = self.loop.call_later(seconds, self.timed_out, seconds)

    def timed_out(self, seconds: float):
        self.deadline = None
        if self.transport.is_closing():
            return
        log.info(TIMED_OUT + " from %s: its request's %s took over %g s", ":".join(map(str, self.client or ())),
                 self.reading, seconds)
        # A 408 for a request begun; a connection that sent nothing of one is closed without a word, as an idle
        # kept-alive one is (a client about to reuse it would read the 408 as its next request's answer).
        begun = self.reading == "body" or bool(self.conn.trailing_data[0])
        if begun and (self.cycle is None or not self.cycle.response_started):
            path = self.scope["path"] if self.reading == "body" else ""
            self.transport.write(raw_response(408, "Request Timeout", error_body_for(
                path, 408, f"the request's {self.reading} took over {seconds:g} s")))
        self.transport.close()


def raw_response(status: int, reason: str, body: dict, headers: bytes = b"") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, written past h11 (which has no request to answer)."""
    content = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(content)}\r\n"
            "connection: close\r\n").encode() + headers + b"\r\n" + content


def connection_limits(max_connections: int, header_timeout_s: float, body_timeout_s: float) -> ConnectionLimits:
    """The limits for this process: the open-files limit raised as far as it may go, and `max_connections` lowered
    to what it holds beside the descriptors already open, so that accept() never fails for want of one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # macOS refuses RLIM_INFINITY; the soft limit then stays
            pass
    if soft == resource.RLIM_INFINITY:
        return ConnectionLimits(max_connections, header_timeout_s, body_timeout_s)
    free = soft - open_files()
    backlog = min(2048, max(16, free // 16))  # uvicorn's 2048 wherever the descriptors allow
    room = free - 2 * backlog - SPARE_FILES  # two loop turns of accepted connections that are about to be closed
    if room < max_connections:
        log.warning("at most %d connections (the open-files limit is %d; `ulimit -n` raises it)", max(room, 1), soft)
    return ConnectionLimits(max(1, min(max_connections, room)), header_timeout_s, body_timeout_s, backlog)


def open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS): a guess
        return 64


class OncePer(logging.Filter):
    """Lets through one record of each message in `messages` every `seconds`; the next one through says how many
    were dropped meanwhile, without their tracebacks."""

    def __init__(self, messages: tuple[str, ...], seconds: float = 10.0):
        super().__init__()
        self.messages, self.seconds = messages, seconds
        self.last: dict[str, float] = {}
        self.dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        key = next((m for m in self.messages if message.startswith(m)), None)
        if key is None:
            return True
        now = time.monotonic()
        if now - self.last.get(key, -self.seconds) < self.seconds:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            return False
        self.last[key] = now
        dropped = self.dropped.pop(key, 0)
        if dropped:
            record.msg = f"{message} ({dropped} more like it since the last one logged)"
        return True


def quiet_connection_logs():
    """asyncio logs each failed accept() with a traceback, thousands a second once the descriptors run out; and a
    client that opens connections only to let them time out should not fill the log either."""
    logging.getLogger("asyncio").addFilter(OncePer(ACCEPT_ERRORS))
    log.addFilter(OncePer((TIMED_OUT,)))
