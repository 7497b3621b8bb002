"""The guard in front of every route: the Host header (DNS rebinding) and the API key, both checked before a byte of
the body is read, so that a client without the key costs no parsing and learns nothing from validation errors."""
from __future__ import annotations

import hmac
import ipaddress

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from fastdecode.server.config import ServerConfig
from fastdecode.server.errors import error_body_for

OPEN_PATHS = {"/health", "/"}  # probes and load balancers; the dashboard page (no data: it asks for the key)
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
    With keys, every path but /health and the dashboard's page (the OpenAPI schema and the dashboard's data included)
    needs one, as `Authorization: Bearer KEY` or `x-api-key: KEY`; the request's state then names its tenant
    (`request.state.tenant`, None without keys)."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.keys = app, [(k.encode(), name) for k, name in config.tenants().items()]
        self.check_host = not self.keys and is_loopback(config.host)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            tenant = self.tenant(headers)
            refusal = self.refusal(scope["path"], headers, tenant)
            if refusal is not None:
                return await refusal(scope, receive, send)
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def tenant(self, headers: Headers) -> str | None:
        """The tenant whose key the request carries (every key compared, in constant time each)."""
        found = None
        for given in sent_keys(headers):
            for key, name in self.keys:
                if hmac.compare_digest(given.encode(), key):
                    found = name
        return found

    def refusal(self, path: str, headers: Headers, tenant: str | None):
        def refuse(status: int, message: str, code: str) -> JSONResponse:  # in the shape of the path's API
            return JSONResponse(error_body_for(path, status, message, code=code), status_code=status)

        if self.check_host and host_name(headers.get("host", "")).lower() not in LOOPBACK_NAMES:
            return refuse(403, "this server answers only requests addressed to localhost (the Host header names "
                               "another site); set an API key to serve other names", "host_not_allowed")
        if not self.keys or path in OPEN_PATHS:
            return None
        if not sent_keys(headers):
            return refuse(401, "Missing API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
                          "missing_api_key")
        if tenant is None:
            return refuse(401, "Incorrect API key provided", "invalid_api_key")
        return None


def sent_keys(headers: Headers) -> list[str]:
    """The keys a request carries: OpenAI's clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`."""
    scheme, _, bearer = headers.get("authorization", "").partition(" ")
    return [k.strip() for k in (bearer if scheme.lower() == "bearer" else "", headers.get("x-api-key", ""))
            if k.strip()]
