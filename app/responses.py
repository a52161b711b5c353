"""JSON and Server-Sent-Events responses.

SSE framing is OpenAI's: every event is exactly `data: <json>\\n\\n` and a stream
ends with `data: [DONE]\\n\\n`. No comments, no `event:` lines, no retries.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"

Payload = dict[str, object]  # one JSON response body or SSE event


def dumps(content: Any) -> bytes:
    try:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:
        # orjson refuses lone surrogates and exotic types; the stdlib escapes them.
        return json.dumps(content, ensure_ascii=True, default=str).encode()


def sse_event(payload: Any) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


class JSONResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that runs `on_close` exactly once when it ends.

    `on_close` runs whether the stream finished, the client went away (starlette
    cancels the body), or the body was never iterated at all, so whatever the
    stream holds (engine requests, an in-flight slot) is always released.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
