"""Pure-ASGI middleware: the request body limit and API-key auth.

Both answer with the OpenAI error envelope and never touch a streaming response
body, so they add no latency to SSE.
"""

from __future__ import annotations

import asyncio
import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import BodyTooLarge, api_error_response, error_response

# Probes and scrapers must work without the key (Kubernetes, Prometheus). /health_generate
# runs the model, so it is not among them. The dashboard's static files hold no data (what
# they show comes from routes behind the key).
OPEN_PATHS = frozenset({"/health", "/metrics", "/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"})

# What is read and dropped of a body the server answered early (see BodyLimitMiddleware).
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_SECONDS = 10.0


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of the request body, within DRAIN_MAX_BYTES and DRAIN_SECONDS."""
    drained = 0
    try:
        async with asyncio.timeout(DRAIN_SECONDS):
            while drained <= DRAIN_MAX_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                drained += len(message.get("body", b""))
    except TimeoutError:
        pass


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes: by Content-Length before reading anything, and by
    counting while a body without (or lying about) Content-Length streams in.

    Invariant: a response that ends before the request body was read to its end (this
    413, a 401, a 404) reads and drops the rest of the body first, bounded, and carries
    `Connection: close`. Closing a socket with unread bytes sends a TCP reset, and the
    client would see that instead of the answer.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        received = 0
        body_done = declared in (None, "0") and "transfer-encoding" not in headers  # no body to read

        async def counted_receive() -> Message:
            nonlocal received, body_done
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.limit:
                    raise BodyTooLarge(self.limit)  # answered by the app's APIError handler
            else:
                body_done = True
            return message

        async def closing_send(message: Message) -> None:
            if not body_done and message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            elif not body_done and message["type"] == "http.response.body" and not message.get("more_body", False):
                await _drain(receive)
            await send(message)

        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await api_error_response(BodyTooLarge(self.limit))(scope, counted_receive, closing_send)
            return
        await self.app(scope, counted_receive, closing_send)


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
