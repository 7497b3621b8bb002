"""Body limits, enforced before the body is parsed: its size in bytes, and how many JSON values it holds (the API
key and Host checks are in security.py, the connection limits in connections.py).

The values bound what parsing and validation cost. Both run on the event loop, and pydantic holds the interpreter
lock while it validates, so no thread would spare the other streams: 200,000 tiny messages took 0.9 s of validation
(1.1-1.5 s between another client's tokens) only to be refused. Counting the values on the raw bytes, in a worker
thread and a slice at a time, costs the loop 10-40 ms for an 8 MB body; at 50,000 values, what parsing and validation
can cost is about 0.3 s (lists fail at their first bad item: schemas.Schema).
"""
from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from fastdecode.server.errors import error_body_for

SLICE_BYTES = 1 << 16  # the count takes the interpreter lock a slice at a time: well under a millisecond each


def json_values(body: bytes, limit: int) -> int:
    """Array elements plus object members in the JSON text `body`, from its bytes: the commas and opening brackets
    outside strings (one for each value but the first of a container, one for that first). An empty [] or {} counts
    one too, so this is an upper bound; it stops once past `limit`. Text that is not JSON gets some count, and the
    parser's 400 after."""
    # With escaped backslashes, then escaped quotes, gone, every quote left opens or closes a string.
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    count, in_string = 0, False
    for start in range(0, len(text), SLICE_BYTES):
        parts = text[start:start + SLICE_BYTES].split(b'"')
        outside = b"".join(parts[1 if in_string else 0::2])
        count += outside.count(b",") + outside.count(b"[") + outside.count(b"{")
        in_string ^= len(parts) % 2 == 0  # an odd number of quotes in the slice
        if count > limit:
            break
    return count


class BodyLimit:
    """ASGI middleware: reads the whole body before the app sees it. Over `max_bytes` (by its Content-Length, or as
    it keeps coming) or over `max_values` JSON values, it gets 413 and the app never runs; otherwise the app reads
    it as if from the client."""

    def __init__(self, app, max_bytes: int, max_values: int):
        self.app, self.max_bytes, self.max_values = app, max_bytes, max_values

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self.refuse(scope, receive, send, f"the request body is over {self.max_bytes} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer (connections.py closes a body that comes too slowly)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self.refuse(scope, receive, send, f"the request body is over {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        # A body has fewer values than bytes: only a long one needs counting.
        values = await run_in_threadpool(json_values, body, self.max_values) if len(body) > self.max_values else 0
        if values > self.max_values:
            return await self.refuse(scope, receive, send, f"the request body holds more than {self.max_values} JSON "
                                     "values (array elements and object members; the server's --max-body-values)")
        await self.app(scope, replay(body, receive), send)

    @staticmethod
    async def refuse(scope, receive, send, message: str):
        await JSONResponse(error_body_for(scope.get("path", ""), 413, message), 413)(scope, receive, send)


def replay(body: bytes, receive):
    """A receive channel that gives `body` once, then whatever the client's channel says (its disconnect)."""
    given = False

    async def replayed():
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
