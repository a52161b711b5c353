"""One bootstrap connection, seen from either end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from runtime.disaggregation.transport import PairGroup, as_memoryview
from runtime.disaggregation.wire import KVLayout, PeerGone, write_frame, write_payload

log = structlog.get_logger("sluice.disaggregation")


@dataclass(eq=False)
class Peer:
    """The connection to one peer server and the rooms bound to it.

    Invariant: a room is in `rooms` from the moment both halves are paired on this
    connection until this side has released it; when the connection dies, every
    room still in `rooms` fails."""

    name: str  # for messages: "decode server 10.0.0.2:41234" / "prefill server host:port"
    writer: asyncio.StreamWriter | None = None
    local_host: str = "127.0.0.1"
    link: int = 0  # names this connection in the orders to the other TP ranks' agents (ranks.py)
    refusal: str | None = None  # the layouts differ: every room here fails with this
    paired: bool = False  # gloo/nccl: payloads travel on a two-rank group, not inline
    group: PairGroup | None = None  # set (and group_ready) once that group is up
    group_ready: asyncio.Event = field(default_factory=asyncio.Event)
    rooms: set[int] = field(default_factory=set)
    closed: bool = False
    next_tag: int = 0
    backlog: list[dict[str, Any]] = field(default_factory=list)  # frames sent before the connection is up

    def send(self, header: dict[str, Any]) -> None:
        """Queue a control frame; kept until connected, dropped once closed."""
        if self.closed:
            return
        if self.writer is None:
            self.backlog.append(header)
        else:
            write_frame(self.writer, header)

    def connected(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        for header in self.backlog:
            write_frame(writer, header)
        self.backlog.clear()

    async def send_kv(self, header: dict[str, Any], payload: torch.Tensor) -> None:
        """A room's header and KV: inline on the connection (tcp) or over the pair group.
        Header writes and send submissions happen with no await between them, so the
        peer posts its receives in the same order."""
        if self.closed or self.writer is None:
            raise PeerGone(f"the connection to the {self.name} is closed")
        if not self.paired:
            view = as_memoryview(payload)
            write_frame(self.writer, header, view.nbytes)
            await write_payload(self.writer, view)
            return
        await self.group_ready.wait()
        group = self.group
        if group is None or self.closed:
            raise PeerGone(f"no transfer group with the {self.name}")
        tag, self.next_tag = self.next_tag, (self.next_tag + 1) % (1 << 31)
        write_frame(self.writer, {**header, "nbytes": payload.numel(), "tag": tag})
        sent = asyncio.get_running_loop().run_in_executor(group.send_executor, group.send, payload, tag)
        await self.writer.drain()
        await sent

    async def accept_pairing(self, backend: str, timeout: float, ok: dict[str, Any], device: torch.device | None = None) -> None:
        """The accepting side's answer to a hello it takes: `ok`; for gloo/nccl, the pair
        group's store is hosted here and this side joins as rank 0."""
        if backend not in ("gloo", "nccl"):
            self.send(ok)
            return
        self.paired = True
        store = PairGroup.host_store(self.local_host, timeout)
        self.send({**ok, "store_port": store.port})
        try:
            self.group = await asyncio.to_thread(PairGroup, backend, store, 0, self.local_host, timeout, device)
        finally:
            self.group_ready.set()

    async def join_pairing(self, backend: str, host: str, store_port: int, timeout: float, device: torch.device | None = None) -> None:
        """The connecting side's half: join the pair group the other side offered, as rank 1."""
        self.paired = True
        try:
            store = await asyncio.to_thread(PairGroup.join_store, host, store_port, timeout)
            self.group = await asyncio.to_thread(PairGroup, backend, store, 1, self.local_host, timeout, device)
        finally:
            self.group_ready.set()

    def close(self) -> None:
        self.closed = True
        if self.writer is not None:
            self.writer.close()
        if self.group is not None:
            self.group.close()
        self.group_ready.set()  # wake senders waiting on a group that will not come


def refusal(layout: KVLayout, backend: str, hello: dict[str, Any]) -> str | None:
    """Why the peer that sent `hello` cannot exchange KV with this side, or None."""
    why = layout.mismatch(KVLayout.from_json(hello["layout"]))
    if why is None and str(hello.get("backend")) != backend:
        why = f"KV transfer backend differs: this server uses {backend}, the peer {hello.get('backend')}"
    return why
