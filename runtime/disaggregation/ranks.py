"""Rank 0's handle on the other tensor-parallel ranks' KV transfers (tp_size > 1).

Each TP rank moves only its own KV heads: prefill rank r sends its slice of every
layer's K and V to decode rank r, which writes it into its own pool. Rank 0 moves
its slice over the bootstrap connection as at tp_size 1 (prefill.py, decode.py);
ranks 1.. each have a connection of their own (rank_agent.py). Only rank 0 has a
scheduler and an allocator, so rank 0 decides and the other ranks' transfer agents
carry it out:

- Orders (`send` room R's slots to decode peer P / `recv` room R into these slots
  from prefill peer P, `drop` an order, `connect`/`disconnect` a peer) go out as
  side messages on the TP batch channel (tp_channel.py): broadcast between two
  steps, in order. A worker rank hands them to its agent's thread and goes back to
  its step loop: it never waits on the network.
- Every agent reports back over one TCP connection to this hub: exactly one report
  per order (done, failed or dropped).

Invariant: a room's slots are rank 0's to free or reuse only once its order is
`settled` (every rank reported): no agent reads or writes them after that. A room
is complete only when rank 0's part and every rank's report say done.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from config.settings import EngineSettings
from runtime.disaggregation.wire import PeerGone, read_frame
from runtime.model_executor.tp_channel import BatchChannel, SideMessage

log = structlog.get_logger("sluice.disaggregation")
Endpoint = tuple[str | None, int]  # a prefill rank's KV sender: (host, None = the bootstrap host's; port)


class RankFailed(ConnectionError):
    """A TP rank's part of a room's transfer failed."""


@dataclass(eq=False)
class RankOrder:
    """One room's transfer on ranks 1..tp_size-1, as rank 0 sees it."""

    oid: int
    waiting: set[int]  # ranks yet to report
    # Done when every rank did its part; RankFailed at the first rank that failed.
    result: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # Done when every rank has reported (done, failed or dropped): the slots are free to go.
    settled: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    nbytes: int = 0
    link_down: bool = False  # a failure was a rank's connection to the peer server
    on_report: Callable[[], None] | None = None  # after every report

    def report(self, rank: int, error: str | None, nbytes: int, link_down: bool) -> None:
        if rank not in self.waiting:
            return
        self.waiting.discard(rank)
        self.nbytes += nbytes
        if error is not None and not self.result.done():
            self.link_down = link_down
            self.result.set_exception(RankFailed(f"tp rank {rank}: {error}"))
            self.result.exception()  # retrieved: a caller that stopped awaiting is no error
        if not self.waiting:
            if not self.result.done():
                self.result.set_result(None)
            self.settled.set_result(None)
        if self.on_report is not None:
            try:
                self.on_report()
            except Exception:  # noqa: BLE001 - the hub must go on reading this rank's reports
                log.exception("handling a tp rank's KV transfer report failed", oid=self.oid)


def hub_host(settings: EngineSettings) -> str:
    """Where rank 0 listens for its agents: the TP rendezvous host (reachable from every node)."""
    return settings.dist_init_addr.rsplit(":", 1)[0] if settings.dist_init_addr else "127.0.0.1"


class RankHub:
    def __init__(self, channel: BatchChannel, on_failure: Callable[[str], None] | None, settings: EngineSettings, model: str) -> None:
        self.channel = channel
        self.model = model  # the KVLayout's model string, which the agents' layouts share
        self.on_failure = on_failure
        self.settings = settings
        self.size = settings.tp_size
        self.endpoints: list[Endpoint | None] = [None] * self.size  # prefill: rank r's KV sender
        self.orders: dict[int, RankOrder] = {}
        self._oids = itertools.count(1)
        self._hello: set[int] = set()
        self._all_here = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._agents: set[asyncio.StreamWriter] = set()  # closed at close: their readers end
        self.closed = False

    async def start(self) -> None:
        """Start the agents on every rank and wait until each has reported in."""
        host = hub_host(self.settings)
        self._server = await asyncio.start_server(self._serve, host=host, port=0)
        port = self._server.sockets[0].getsockname()[1]
        self.channel.start_side(self.on_failure)
        self.post({"op": "setup", "hub": [host, port], "model": self.model})
        try:
            await asyncio.wait_for(self._all_here.wait(), self.settings.dist_timeout)
        except TimeoutError:
            missing = sorted(set(range(1, self.size)) - self._hello)
            raise RuntimeError(f"the KV transfer agents of tp ranks {missing} did not report in within {self.settings.dist_timeout:g} s") from None

    def close(self) -> None:
        self.closed = True
        if self._server is not None:
            self._server.close()
        for writer in self._agents:
            writer.close()

    def post(self, header: dict[str, Any], slots: torch.Tensor | None = None) -> None:
        if self.closed:
            return
        self.channel.post(SideMessage(header) if slots is None else SideMessage(header, slots.to(torch.int64)))

    def order(self, header: dict[str, Any], slots: torch.Tensor, on_report: Callable[[], None] | None = None) -> RankOrder:
        """Have every other rank move its heads of `slots` (`header`: op, room, peer)."""
        order = RankOrder(next(self._oids), set(range(1, self.size)), on_report=on_report)
        self.orders[order.oid] = order
        order.settled.add_done_callback(lambda _: self.orders.pop(order.oid, None))
        self.post({**header, "oid": order.oid}, slots)
        return order

    def drop(self, order: RankOrder) -> None:
        """The room ended: ranks that have not finished give up (and report so)."""
        if order.waiting:
            self.post({"op": "drop", "oid": order.oid})

    async def settle(self, order: RankOrder, failed: bool) -> int:
        """Until no rank reads or writes the room's slots any more (each gives up, if
        the room `failed`); the bytes they moved."""
        if failed:
            self.drop(order)
        await order.settled
        return order.nbytes

    # ---- the agents' reports ----------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        rank = -1
        self._agents.add(writer)
        try:
            hello, _ = await read_frame(reader)
            rank = int(hello["rank"])
            endpoint = hello.get("endpoint")
            self.endpoints[rank] = None if endpoint is None else (endpoint[0], int(endpoint[1]))
            self._hello.add(rank)
            if len(self._hello) == self.size - 1:
                self._all_here.set()
            while True:
                report, _ = await read_frame(reader)
                order = self.orders.get(int(report["oid"]))
                if order is not None:
                    order.report(rank, report.get("error"), int(report.get("nbytes", 0)), bool(report.get("link_down")))
        except (PeerGone, OSError, KeyError, ValueError) as exc:
            if rank > 0 and not self.closed:  # its process is gone or wedged: it touches no slot any more
                log.error("a tp rank's KV transfer agent went away", rank=rank, error=str(exc))
                for order in list(self.orders.values()):
                    order.report(rank, f"its KV transfer agent went away ({exc})", 0, True)
        finally:
            self._agents.discard(writer)
            writer.close()
