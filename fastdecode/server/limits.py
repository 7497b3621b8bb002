"""Request guards that act before a route runs: the body size limit and the API key."""
from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fastdecode.server.errors import ApiError, error_body_for


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
            response = JSONResponse(error_body_for(scope.get("path", ""), 413,
                                                   f"the request body is over {self.max_bytes} bytes"), 413)
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
    """A route dependency: 401 unless `Authorization: Bearer <api_key>` or, as Anthropic's clients send it,
    `x-api-key: <api_key>` (compared in constant time)."""
    def check(request: Request):
        if api_key is None:
            return
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        given = [key.strip() for key in (bearer if scheme.lower() == "bearer" else "",
                                         request.headers.get("x-api-key", "")) if key.strip()]
        if not given:
            raise ApiError(401, "Missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
                           code="missing_api_key")
        if not any(hmac.compare_digest(key.encode(), api_key.encode()) for key in given):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
    return check
