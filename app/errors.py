"""OpenAI's error envelope and the exception handlers that produce it.

Every error the server answers has the shape
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`
and a 4xx/5xx status. Handlers never raise, so an error can never become a hang.
"""

from __future__ import annotations

from typing import Any

import pydantic
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from app.responses import JSONResponse
from runtime.errors import InvalidRequest

log = structlog.get_logger("sluice.app")

_HTTP_CODES: dict[int, tuple[str, str]] = {
    # status: (type, code)
    400: ("invalid_request_error", "invalid_value"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    422: ("invalid_request_error", "invalid_value"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "server_unavailable"),
}


class APIError(Exception):
    """An error answered with the OpenAI envelope and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body is larger than the limit of {limit} bytes.")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    type_, default_code = _HTTP_CODES.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    return {"error": {"message": message, "type": type_, "param": param, "code": code or default_code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
) -> Response:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def api_error_response(exc: APIError) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


def from_invalid_request(exc: InvalidRequest) -> APIError:
    """The engine's pre-queue validation error, as a 400."""
    return APIError(400, str(exc) or "Invalid request.", param=exc.param)


# What a union-typed field accepts, said once instead of one error per union branch.
UNION_HINTS: dict[str, str] = {
    "prompt": "a non-empty string, a non-empty list of token ids, a list of strings, or a list of token-id lists",
    "input": "a non-empty string, a list of non-empty strings, a non-empty list of token ids, or a list of token-id lists",
    "stop": "a non-empty string or a list of non-empty strings",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
}


def _is_union_tag(part: object) -> bool:
    """Pydantic names union branches in `loc` ('str', 'list[int]', 'function-after[...]', 'Model')."""
    return isinstance(part, str) and ("[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool"))


def from_validation_error(exc: pydantic.ValidationError) -> APIError:
    """Pydantic's errors as one readable 400; `param` is the first offending field."""
    errors = exc.errors(include_url=False, include_input=False)
    messages: dict[str, str] = {}  # param -> message, first error per param wins
    for e in errors:
        loc = list(e["loc"])
        tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
        if tag is not None:
            where = [str(p) for p in loc[:tag]]
            field = where[-1] if where else ""
            message = f"must be {UNION_HINTS[field]}" if field in UNION_HINTS else "does not match any accepted type"
        else:
            where = [str(p) for p in loc]
            message = e["msg"].removeprefix("Value error, ")
        messages.setdefault(".".join(where), message)
    parts = [f"{param}: {message}" if param else message for param, message in list(messages.items())[:5]]
    if len(messages) > 5:
        parts.append(f"... and {len(messages) - 5} more")
    param = next(iter(messages), "") or None
    return APIError(400, "; ".join(parts), param=param)


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return api_error_response(exc)


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Route {request.method} {request.url.path} not found."
    elif exc.status_code == 405:
        message = f"Method {request.method} not allowed on {request.url.path}."
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, headers=dict(exc.headers or {}))


async def handle_invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, InvalidRequest)
    return api_error_response(from_invalid_request(exc))


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    # Reaching this is a bug: tests assert that fuzzed input never does.
    log.error("unhandled exception", path=request.url.path, exc_info=exc)
    return error_response(500, f"Internal server error: {type(exc).__name__}")


EXCEPTION_HANDLERS: dict[Any, Any] = {
    APIError: handle_api_error,
    HTTPException: handle_http_exception,
    InvalidRequest: handle_invalid_request,
    Exception: handle_unexpected,
}
