"""The scheduler's view of prefill/decode disaggregation (implemented in runtime/disaggregation/).

The scheduler calls these hooks at four points and knows nothing else about
bootstrap connections or KV transfer. Every call runs on the scheduler's loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from runtime.managers.req import Req


@dataclass(frozen=True, slots=True)
class DisaggQueues:
    mode: str = "null"  # "prefill" | "decode"
    bootstrap: int = 0  # prefill: waiting for their decode peer (PrefillBootstrapQueue)
    inflight: int = 0  # prefill: computed, KV being sent, held until acknowledged
    prealloc: int = 0  # decode: waiting for a row and KV slots (DecodePreallocQueue)
    transfer: int = 0  # decode: slots reserved, KV awaited (DecodeTransferQueue)


class Disaggregation(Protocol):
    mode: str  # "prefill" | "decode"

    def add(self, req: Req) -> bool:
        """Take a new request into this side's queues; False: it goes to the waiting queue."""
        ...

    def abort(self, req: Req) -> bool:
        """End a request held in this side's queues (it is finished when this returns True)."""
        ...

    def hold(self, req: Req, kv_len: int) -> bool:
        """`req` just got its finish reason. True: its KV is being sent and the scheduler
        must not release it; `Scheduler.release_held` will."""
        ...

    def poll(self) -> tuple[list[Req], list[Req]]:
        """(requests ready to prefill, requests whose KV arrived ready to decode)."""
        ...

    def queues(self) -> DisaggQueues: ...

    def info(self) -> dict[str, Any]: ...
