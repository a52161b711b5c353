"""Pure-ASGI middleware: API-key auth and the request body limit.

Both answer with the OpenAI error envelope and never touch a streaming response
body, so they add no latency to SSE.
"""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import BodyTooLarge, error_response

# Probes and scrapers must work without the key (Kubernetes, Prometheus).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


class AuthMiddleware:
    """`Authorization: Bearer <api_key>` on every route but OPEN_PATHS."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode("latin-1")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        message = "Missing API key." if not given else "Incorrect API key provided."
        response = error_response(401, message, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: by Content-Length before reading anything, and
    by counting while a body without (or lying about) Content-Length streams in."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            response = error_response(413, BodyTooLarge(self.limit).message, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        await self.app(scope, limited_receive, send)
