"""Race work against the client going away.

Once a request's body has been read, the only ASGI message left to receive is
`http.disconnect`, so a task blocked on `receive()` wakes exactly when the client
closes the connection. Hypercorn's receive is a queue get, so cancelling the
watcher loses no message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first: then cancel it and raise."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
