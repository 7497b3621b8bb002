"""The guard in front of every route: the Host header (DNS rebinding) and the API key, both checked before a byte of
the body is read, so that a client without the key costs no parsing and learns nothing from validation errors."""
from __future__ import annotations

import hmac
import ipaddress

from starlette.datastructures import Headers

from fastdecode.server.config import ServerConfig
from fastdecode.server.errors import error_response

OPEN_PATHS = {"/health"}  # probes and load balancers call it without a key
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "localhost:8000" -> "localhost"."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware. A loopback server without a key answers only requests whose Host names the loopback: a web
    page whose own domain it rebinds to 127.0.0.1 still sends that domain as Host, and a browser cannot forge it.
    With a key, every path but /health (the OpenAPI schema included) needs `Authorization: Bearer KEY`."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.api_key = app, config.api_key
        self.check_host = config.api_key is None and is_loopback(config.host)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope["path"], Headers(scope=scope))
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, path: str, headers: Headers):
        if self.check_host and host_name(headers.get("host", "")).lower() not in LOOPBACK_NAMES:
            return error_response(403, "this server answers only requests addressed to localhost (the Host header "
                                       "names another site); set an API key to serve other names",
                                  code="host_not_allowed")
        if self.api_key is None or path in OPEN_PATHS:
            return None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return error_response(401, "Missing API key: send it as `Authorization: Bearer <key>`",
                                  code="missing_api_key")
        if not hmac.compare_digest(given.strip().encode(), self.api_key.encode()):
            return error_response(401, "Incorrect API key provided", code="invalid_api_key")
        return None
