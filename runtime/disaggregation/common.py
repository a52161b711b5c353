"""What both sides share: the resolved backend, the request's error, transfer stats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from config.settings import EngineSettings
from runtime.managers.req import FinishReason, Req

UNAVAILABLE = 503  # the peer, not the client, is at fault: a router may retry elsewhere
EWMA = 0.2


def transfer_backend(settings: EngineSettings) -> str:
    """`auto` -> tcp on CPU, nccl on CUDA."""
    backend = settings.disaggregation_transfer_backend
    if backend != "auto":
        return backend
    return "nccl" if settings.device == "cuda" else "tcp"


def peer_error(message: str) -> FinishReason:
    return FinishReason("abort", message=message, status_code=UNAVAILABLE)


def kv_frame(req: Req, room: int) -> dict[str, Any]:
    """The header of a prefilled room's KV: its first token (with logprobs) and cache hits."""
    header: dict[str, Any] = {"op": "kv", "room": room, "first_token": req.output_ids[0], "cached_tokens": req.cached_tokens}
    if req.output_token_logprobs:
        header["logprob"] = req.output_token_logprobs[0][0]
    if req.output_top_logprobs:
        header["top"] = req.output_top_logprobs[0]
    return header


def adopt_prefill(req: Req, header: dict[str, Any]) -> None:
    """A decode request whose prompt KV is in place: the prefill server's `kv` frame
    gives it its first token (with logprobs) and its prompt as prefilled."""
    first = int(header["first_token"])
    req.output_ids.append(first)
    if req.return_logprob and "logprob" in header:
        req.output_token_logprobs.append((float(header["logprob"]), first))
        if "top" in header:
            req.output_top_logprobs.append([(float(lp), int(t)) for lp, t in header["top"]])
    req.fill_ids = list(req.origin_input_ids)
    req.cached_tokens = int(header.get("cached_tokens", 0))
    req.row_dirty = True  # the worker has never seen this row
    req.trace.kv_received()


@dataclass(slots=True)
class DisaggStats:
    """KV transfer counters (bytes, count, seconds) and a smoothed latency, for /metrics."""

    transfers: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0
    latency_ewma: float = 0.0
    started: dict[int, float] = field(default_factory=dict)  # room -> monotonic start

    def start(self, room: int) -> None:
        self.started[room] = time.monotonic()

    def done(self, room: int, nbytes: int, ok: bool) -> None:
        t0 = self.started.pop(room, None)
        if not ok:
            self.failed += 1
            return
        dt = time.monotonic() - t0 if t0 is not None else 0.0
        self.transfers += 1
        self.bytes += nbytes
        self.seconds += dt
        self.latency_ewma = dt if self.transfers == 1 else (1 - EWMA) * self.latency_ewma + EWMA * dt

    def info(self) -> dict[str, Any]:
        return {
            "kv_transfers_total": self.transfers,
            "kv_transfer_failures_total": self.failed,
            "kv_transfer_bytes_total": self.bytes,
            "kv_transfer_seconds_total": self.seconds,
            "kv_transfer_latency_seconds": self.latency_ewma,
        }


class Tasks:
    """A side's background tasks (connections, transfers, the reaper), cancelled together."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # held: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
