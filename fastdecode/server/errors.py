"""Every error the server answers, in the shape of the API its path belongs to: OpenAI's
{"error": {"message", "type", "param", "code"}}, or on /v1/messages Anthropic's
{"type": "error", "error": {"type", "message"}} (its SDK and Claude Code read only that one). Messages that repeat
what a request said are made sendable first (sendable)."""
from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from fastdecode.errors import EngineUnavailable, FastdecodeError

log = logging.getLogger(__name__)
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         429: "rate_limit_error", 503: "server_overloaded", 500: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   504: "timeout_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def sendable(text: str | None) -> str | None:
    """`text` with any lone surrogate written as its escape (`\\ud800`): JSON can spell one in a request, UTF-8
    cannot carry it, and an error message that repeats the request's model name or call id must still be sent."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if text is not None else None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    message, param = sendable(message), sendable(param)
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error" if status < 500
                                                              else "server_error"),
                      "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict:
    message = sendable(message)
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500
                                                                   else "api_error"), "message": message}}


def error_body_for(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_error_body(status, message)
    return error_body(status, message, param, code)


def error_response(request: Request, status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body_for(request.url.path, status, message, param, code), status_code=status,
                        headers=headers)


def internal_error(exc: BaseException, request_id: str | None = None) -> dict:
    """A bug of ours or a failed engine: logged in full under a request id, answered with that id and nothing of the
    exception's text (it may hold paths, prompts or other users' state)."""
    request_id = request_id or f"req-{secrets.token_hex(8)}"
    log.error("request %s failed: %s", request_id, type(exc).__name__, exc_info=exc)
    return error_body(500, f"internal error (request {request_id}); the server's log has the details",
                      code="internal_error")


def stream_failure(exc: BaseException, request_id: str) -> tuple[int, str]:
    """(status, message) of the error event that ends a stream the engine failed mid-way: a request's own mistake
    (FastdecodeError, whose messages are written for the client) says what it was, a lost engine (a cluster's replica)
    is a 503; anything else is an internal error, logged under the request id."""
    if isinstance(exc, FastdecodeError):
        return 400, sendable(str(exc))
    if isinstance(exc, EngineUnavailable):
        return 503, str(exc)
    return 500, internal_error(exc, request_id)["error"]["message"]


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first error as one sentence, and the parameter it names ("messages.0.role")."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}", None
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {'.'.join(loc)}", ".".join(loc) or None
    if first.get("type") == "missing":
        return f"Missing required parameter: '{'.'.join(loc)}'", ".".join(loc) or None
    param = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{first.get('msg', 'invalid value')}{' at ' + param if param else ''}{more}", param


def install_error_handlers(app: FastAPI):
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(request, exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(FastdecodeError)
    async def engine_error(request: Request, exc: FastdecodeError):
        return error_response(request, 400, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(request, 400, message, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message = "the request body is not valid UTF-8"
        return error_response(request, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):  # a bug of ours: logged, answered without its text
        return error_response(request, 500, internal_error(exc)["error"]["message"])
