"""The live dashboard.

GET /dashboard serves one page from app/dashboard/ (plain HTML, CSS and JS: no CDN, no
library), which needs no key: it holds no data. It reads GET /dashboard/events, one
server-sent event a second (engine state, throughput, TTFT/ITL percentiles over the
last minute, recent requests), and GET /v1/requests/{rid}/trace (routes_trace.py),
both behind the API key like every route but the probes; the page sends the key from
its URL fragment (`/dashboard#key=...`, which browsers never send) in a header.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator
from functools import cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from app.responses import Payload, SSEResponse, sse_event
from app.serving import app_state
from app.state import AppState, Phase

DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboard"
# path -> (file in DASHBOARD_DIR, content type); these paths need no API key (app.middleware).
STATIC: dict[str, tuple[str, str]] = {
    "/dashboard": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
INTERVAL_S = 1.0  # between two events
RATE_WINDOW_S = 5.0  # throughput is averaged over this much history
RECENT_REQUESTS = 50  # rows of the requests table


@cache
def _static(name: str) -> bytes:
    return (DASHBOARD_DIR / name).read_bytes()


async def dashboard_file(request: Request) -> Response:
    name, media_type = STATIC[request.url.path]
    return Response(_static(name), media_type=media_type, headers={"Cache-Control": "no-cache"})


async def dashboard_events(request: Request) -> Response:
    state = app_state(request)
    state.ready_engine()
    return SSEResponse(_events(state), on_close=lambda: None)


class Rates:
    """Prefill and decode tokens per second from the engine's counters, over RATE_WINDOW_S."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def update(self, now: float, info: dict[str, object]) -> dict[str, float]:
        prefill, decode = info.get("prefill_tokens_total"), info.get("generation_tokens_total")
        self._samples.append((now, prefill if isinstance(prefill, int) else 0, decode if isinstance(decode, int) else 0))
        while len(self._samples) > 2 and self._samples[1][0] <= now - RATE_WINDOW_S:
            self._samples.popleft()
        t0, p0, d0 = self._samples[0]
        span = now - t0
        if span <= 0:
            return {"prefill": 0.0, "decode": 0.0}
        return {"prefill": (self._samples[-1][1] - p0) / span, "decode": (self._samples[-1][2] - d0) / span}


def snapshot(state: AppState, rates: Rates) -> Payload:
    """One event: what the page shows, read at once."""
    engine = state.ready_engine()
    info = engine.get_server_info()
    now = time.perf_counter()  # RequestTimer's clock
    return {
        "time": time.time(),
        "model": state.model_name,
        "phase": state.phase.value,
        "server": info,
        "throughput": rates.update(now, info),
        "latency": {"ttft": state.metrics.recent_ttft.percentiles(now), "itl": state.metrics.recent_itl.percentiles(now)},
        "requests": engine.recent_traces(RECENT_REQUESTS),
    }


async def _events(state: AppState) -> AsyncIterator[bytes]:
    """An event a second until the server stops serving (the client leaving cancels it)."""
    rates = Rates()
    while state.phase in (Phase.READY, Phase.STARTING):
        yield sse_event(snapshot(state, rates))
        await asyncio.sleep(INTERVAL_S)
