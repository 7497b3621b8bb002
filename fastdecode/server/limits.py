"""Request guards that act before a route runs: the body size limit and the bearer API key."""
from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fastdecode.server.errors import ApiError, error_body


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413, whether its Content-Length says so or it just keeps
    coming (chunked)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            response = JSONResponse(error_body(413, f"the request body is over {self.max_bytes} bytes"), 413)
            return await response(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI re-raises an HTTPException met while reading the body
                    raise HTTPException(413, f"the request body is over {self.max_bytes} bytes")
            return message

        await self.app(scope, limited, send)


def bearer_check(api_key: str | None):
    """A route dependency: 401 unless `Authorization: Bearer <api_key>` (compared in constant time)."""
    def check(request: Request):
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise ApiError(401, "Missing API key: send it as `Authorization: Bearer <key>`", code="missing_api_key")
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
    return check
