"""Prefill server: the bootstrap server, the PrefillBootstrapQueue and the KV senders.

A room's life here: its request waits in `bootstrap_queue` (or its decode peer's
`prealloc` waits in `early`, whichever comes first); paired, it is `bound` to that
peer and goes to the waiting queue; once prefilled (max_new_tokens = 1) it is held
in `inflight` while its KV is sent, and released when the peer acknowledges or the
transfer fails. A room the decode side ended before its request arrived is kept in
`failed` so that request ends at once. Stale entries expire after the timeout.

At tp_size > 1 this is rank 0: it sends its own heads as above and orders every
other rank to send theirs to the decode server's same rank (ranks.py); a room is
acknowledged only when every rank's part went out and the decode side acked, and
its slots are released only once every rank has reported on it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog
import torch

from config.settings import EngineSettings
from runtime.disaggregation.common import DisaggStats, Tasks, kv_frame, peer_error, transfer_backend
from runtime.disaggregation.peer import Peer, refusal
from runtime.disaggregation.ranks import RankHub
from runtime.disaggregation.transport import gather_kv
from runtime.disaggregation.wire import STREAM_LIMIT, KVLayout, PeerGone, read_frame
from runtime.managers.disagg_hooks import DisaggQueues
from runtime.managers.req import FinishReason, Req

if TYPE_CHECKING:
    from runtime.managers.scheduler import Scheduler

log = structlog.get_logger("sluice.disaggregation")
REAP_INTERVAL = 0.5


def _room(req: Req) -> int:
    """The request's bootstrap room; -1 (no room) without one."""
    return req.bootstrap.room if req.bootstrap is not None else -1


class PrefillDisaggregation:
    mode = "prefill"

    def __init__(
        self, scheduler: Scheduler, buffers: list[torch.Tensor], layout: KVLayout, settings: EngineSettings, ranks: RankHub | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.ranks = ranks  # the other TP ranks' senders (tp_size > 1)
        self.buffers = buffers
        self.layout = layout
        self.backend = transfer_backend(settings)
        self.port = settings.disaggregation_bootstrap_port
        self.timeout = settings.disaggregation_timeout
        self.bootstrap_queue: dict[int, tuple[Req, float]] = {}  # PrefillBootstrapQueue: room -> (req, deadline)
        self.bootstrapped: list[Req] = []  # paired since the last poll
        self.bound: dict[int, tuple[Req, Peer]] = {}
        self.early: dict[int, tuple[Peer, int, float]] = {}  # room -> (peer, prompt_len, deadline)
        self.failed: dict[int, tuple[str, float]] = {}  # room -> (why, deadline)
        self.inflight: dict[int, Req] = {}
        self.acks: dict[int, asyncio.Future[None]] = {}
        self.peers: set[Peer] = set()
        self.stats = DisaggStats()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="sluice-kv-gather")
        self._tasks = Tasks()
        self._server: asyncio.Server | None = None
        self._links = itertools.count(1)

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        if self.ranks is not None:  # every rank's KV sender is up before a decode server asks
            await self.ranks.start()
        # All interfaces, as SGLang's bootstrap server: decode servers on other hosts reach it.
        self._server = await asyncio.start_server(self._serve, host="0.0.0.0", port=self.port, limit=STREAM_LIMIT)
        self._tasks.spawn(self._reap())
        log.info("bootstrap server listening", port=self.port, backend=self.backend)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._tasks.cancel()
        for peer in self.peers:
            peer.close()
        if self.ranks is not None:
            self.ranks.close()
        self._pool.shutdown(wait=False)

    # ---- scheduler hooks -------------------------------------------------------------------
    def add(self, req: Req) -> bool:
        sp = copy.copy(req.sampling_params)  # the caller may share it: change a copy
        sp.max_new_tokens = 1  # the first token comes from here; the decode server makes the rest
        req.sampling_params = sp
        info = req.bootstrap
        if info is None or info.is_fake or self.backend == "fake":
            return False
        room = info.room
        if room in self.bootstrap_queue or room in self.bound:
            self.scheduler.finish(req, FinishReason("abort", message=f"bootstrap_room {room} is already in use", status_code=400))
        elif (failed := self.failed.pop(room, None)) is not None:
            self.scheduler.finish(req, peer_error(failed[0]))
        elif (early := self.early.pop(room, None)) is not None:
            self._bind(req, early[0], early[1])
        else:
            self.bootstrap_queue[room] = (req, time.monotonic() + self.timeout)
            req.trace.queued("bootstrap")
        return True

    def abort(self, req: Req) -> bool:
        room = _room(req)
        if room in self.bootstrap_queue:
            del self.bootstrap_queue[room]
            self.failed[room] = ("the request was aborted on the prefill server", time.monotonic() + self.timeout)
        elif req in self.bootstrapped:
            self.bootstrapped.remove(req)
            self._unbind(room, "the request was aborted on the prefill server")
        elif room in self.inflight:  # finished, KV on its way: the transfer fails, then releases it
            if (ack := self.acks.get(room)) is not None and not ack.done():
                ack.set_exception(PeerGone("the request was aborted on the prefill server"))
            return True
        else:
            return False
        self.scheduler.finish(req, FinishReason("abort", message="aborted"))
        return True

    def hold(self, req: Req, kv_len: int) -> bool:
        room = _room(req)
        entry = self.bound.get(room)
        if entry is None or entry[0] is not req:
            return False
        assert req.finished_reason is not None
        if req.finished_reason.type == "abort":
            self._unbind(room, req.finished_reason.message or "the request was aborted on the prefill server")
            return False
        self.inflight[room] = req
        self._tasks.spawn(self._send_kv(req, room, entry[1], kv_len))
        return True

    def poll(self) -> tuple[list[Req], list[Req]]:
        ready, self.bootstrapped = self.bootstrapped, []
        return ready, []

    def queues(self) -> DisaggQueues:
        return DisaggQueues("prefill", bootstrap=len(self.bootstrap_queue), inflight=len(self.inflight))

    def info(self) -> dict[str, Any]:
        return {"disaggregation_mode": "prefill", **self.stats.info()}

    # ---- pairing ---------------------------------------------------------------------------
    def _bind(self, req: Req, peer: Peer, prompt_len: int) -> None:
        room = _room(req)
        why = peer.refusal
        if why is None and prompt_len != len(req.origin_input_ids):
            why = (f"bootstrap_room {room}: the decode server's prompt has {prompt_len} tokens and this "
                   f"server's {len(req.origin_input_ids)}: they are not the same request")
        if why is not None:
            peer.send({"op": "error", "room": room, "message": why})
            self.scheduler.finish(req, peer_error(why))
            return
        self.bound[room] = (req, peer)
        peer.rooms.add(room)
        self.bootstrapped.append(req)
        req.trace.queued("waiting")  # the scheduler's next poll moves it there
        self.scheduler.wake()

    def _unbind(self, room: int, notify: str | None = None) -> None:
        entry = self.bound.pop(room, None)
        if entry is not None:
            entry[1].rooms.discard(room)
            if notify is not None:
                entry[1].send({"op": "abort", "room": room, "message": notify})

    def _on_prealloc(self, peer: Peer, room: int, prompt_len: int) -> None:
        if (queued := self.bootstrap_queue.pop(room, None)) is not None:
            self._bind(queued[0], peer, prompt_len)
        elif (failed := self.failed.pop(room, None)) is not None:
            peer.send({"op": "error", "room": room, "message": failed[0]})
        elif room in self.bound:
            peer.send({"op": "error", "room": room, "message": f"bootstrap_room {room} is already in use"})
        else:
            self.early[room] = (peer, prompt_len, time.monotonic() + self.timeout)

    def _on_peer_abort(self, room: int, why: str) -> None:
        """The decode side ended `room` (its client left, it failed, or its peer died)."""
        if (queued := self.bootstrap_queue.pop(room, None)) is not None:
            self.scheduler.finish(queued[0], peer_error(why))
        elif (ack := self.acks.get(room)) is not None:
            if not ack.done():
                ack.set_exception(PeerGone(why))
        elif (entry := self.bound.get(room)) is not None:
            req = entry[0]
            self._unbind(room)
            if req in self.bootstrapped:
                self.bootstrapped.remove(req)
                self.scheduler.finish(req, peer_error(why))
            else:
                self.scheduler.abort(req.rid, peer_error(why))  # waiting or running: ends at its next round
        else:
            self.early.pop(room, None)
            self.failed[room] = (why, time.monotonic() + self.timeout)

    # ---- the KV sender -------------------------------------------------------------------
    async def _send_kv(self, req: Req, room: int, peer: Peer, kv_len: int) -> None:
        loop = asyncio.get_running_loop()
        ack = self.acks[room] = loop.create_future()
        self.stats.start(room)
        nbytes, error, order = 0, None, None
        try:
            # The slots are read now: the row is ours until release_held.
            slots = self.scheduler.req_to_token_pool.req_to_token[req.row, : len(req.origin_input_ids)].to(torch.int64)
            if self.ranks is not None:
                order = self.ranks.order({"op": "send", "room": room, "link": peer.link}, slots)
            payload = await loop.run_in_executor(self._pool, gather_kv, self.buffers, slots)
            nbytes = payload.numel()
            await peer.send_kv(kv_frame(req, room), payload)
            await asyncio.wait_for(ack if order is None else asyncio.gather(ack, order.result), self.timeout)
        except Exception as exc:  # noqa: BLE001 - every failure ends the room the same way
            error = peer_error(f"KV transfer of bootstrap_room {room} to the {peer.name} failed: {str(exc) or type(exc).__name__}")
            log.warning("KV transfer failed", room=room, error=error.message)
        if order is not None and self.ranks is not None:  # until no other rank reads the slots
            nbytes += await self.ranks.settle(order, failed=error is not None)
        self.acks.pop(room, None)
        self._unbind(room, error.message if error is not None else None)
        self.inflight.pop(room, None)
        self.stats.done(room, nbytes, error is None)
        req.trace.kv_sent(None if error is None else error.message)
        self.scheduler.release_held(req, kv_len, error)

    # ---- the bootstrap server ----------------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        local_host, addr = writer.get_extra_info("sockname")[0], writer.get_extra_info("peername")
        peer = Peer(f"decode server {addr[0]}:{addr[1]}", writer, local_host, link=next(self._links))
        self.peers.add(peer)
        why = "closed"
        try:
            hello, _ = await read_frame(reader)
            if hello["op"] != "hello":
                raise PeerGone(f"expected hello, got {hello['op']}")
            await self._handshake(peer, hello)
            while True:
                header, _ = await read_frame(reader)
                op, room = header["op"], int(header.get("room", -1))
                if op == "prealloc":
                    self._on_prealloc(peer, room, int(header["prompt_len"]))
                elif op == "ack" and (ack := self.acks.get(room)) is not None and not ack.done():
                    ack.set_result(None)
                elif op == "abort":
                    self._on_peer_abort(room, str(header.get("message") or "aborted by the decode server"))
        except (PeerGone, OSError) as exc:
            why = str(exc) or type(exc).__name__
        finally:
            peer.close()
            self.peers.discard(peer)
            if self.ranks is not None and not self.ranks.closed:
                self.ranks.post({"op": "disconnect", "link": peer.link})
            for room in list(peer.rooms):
                self._on_peer_abort(room, f"the {peer.name} went away ({why})")
            for room in [r for r, e in self.early.items() if e[0] is peer]:
                del self.early[room]

    async def _handshake(self, peer: Peer, hello: dict[str, Any]) -> None:
        peer.refusal = refusal(self.layout, self.backend, hello)
        if peer.refusal is not None:
            peer.refusal = f"the prefill and decode servers cannot exchange KV: {peer.refusal}"
            log.error("decode server refused", peer=peer.name, reason=peer.refusal)
            peer.send({"op": "refused", "message": peer.refusal})
            return
        # At tp_size > 1: where the decode server's rank r finds this server's rank r.
        ok = {"op": "hello_ok"} if self.ranks is None else {"op": "hello_ok", "link": peer.link, "endpoints": self.ranks.endpoints}
        await peer.accept_pairing(self.backend, self.timeout, ok)

    async def _reap(self) -> None:
        """Expire requests whose decode peer never came, and stale pairing records."""
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for room, (req, deadline) in list(self.bootstrap_queue.items()):
                if deadline < now:
                    del self.bootstrap_queue[room]
                    self.scheduler.finish(req, peer_error(
                        f"no decode server claimed bootstrap_room {room} within {self.timeout:g} s"))
            for table in (self.early, self.failed):
                for room in [r for r, e in table.items() if e[-1] < now]:
                    del table[room]
