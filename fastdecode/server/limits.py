"""The body size limit, enforced as the body arrives (the API key and Host checks are in security.py)."""
from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fastdecode.server.errors import error_body_for


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
