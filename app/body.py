"""Request bodies: one media-type rule and one strict JSON parser for every route."""

from __future__ import annotations

from typing import TypeVar

import pydantic
import pydantic_core
from starlette.requests import Request

from app.errors import APIError, from_validation_error

M = TypeVar("M", bound=pydantic.BaseModel)

JSON_MEDIA_TYPE = "application/json"


def check_media_type(content_type: str | None) -> None:
    """415 unless the body is declared `application/json` (a charset parameter is fine).
    Browsers send text/plain and forms cross-origin without a CORS preflight, never JSON,
    so this keeps any web page from driving a local server."""
    media_type, *params = (content_type or "").split(";")
    names = {p.partition("=")[0].strip().lower() for p in params}
    if media_type.strip().lower() != JSON_MEDIA_TYPE or names - {"charset"}:
        got = f"got {content_type!r}" if content_type else "none was given"
        raise APIError(415, f"The request body must be sent as Content-Type: {JSON_MEDIA_TYPE}; {got}.",
                       param="Content-Type")


def parse_json(raw: bytes) -> object:
    """RFC 8259 JSON: NaN, Infinity and -Infinity are refused, as are invalid UTF-8,
    lone surrogate escapes and trailing bytes."""
    try:
        return pydantic_core.from_json(raw, allow_inf_nan=False)
    except ValueError as exc:
        raise APIError(400, f"Malformed JSON body: {exc}", code="invalid_json") from None


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as `model`: 415, 400 (malformed JSON) or 400 (invalid fields) otherwise."""
    raw = await request.body()
    check_media_type(request.headers.get("content-type"))
    try:
        return model.model_validate(parse_json(raw))
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from exc
