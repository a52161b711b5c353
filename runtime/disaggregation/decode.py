"""Decode server: the DecodePreallocQueue, the DecodeTransferQueue and the KV receivers.

A room's life here: its request waits in `prealloc_queue` until a row and slots for
its prompt can be reserved without taking the decode headroom of the requests
already running; then a `prealloc` goes to its prefill server and it waits in
`transfer_queue` until the KV and first token arrive and are scattered into its
slots (then `ack`); then `poll` hands it to the scheduler, which adds it to the
running batch (`Scheduler.admit_prebuilt`).

At tp_size > 1 this is rank 0: it receives its own heads as above and orders every
other rank to receive theirs from the prefill server's same rank into the same
slots (ranks.py); a room is complete when its KV is in place on every rank.

Invariant: a request in `transfer_queue` or `ready` owns its row and slots here
(its `req_pool_idx` is set, nothing in the tree); ending it frees both. A room
whose KV is being scattered when it ends, here or on any rank, keeps them until
every scatter is done.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch

from config.settings import EngineSettings
from runtime.disaggregation.common import DisaggStats, Tasks, adopt_prefill, peer_error, transfer_backend
from runtime.disaggregation.peer import Peer
from runtime.disaggregation.prealloc import DecodePreallocQueue
from runtime.disaggregation.ranks import RankHub, RankOrder
from runtime.disaggregation.transport import payload_from_bytes, scatter_kv
from runtime.disaggregation.wire import STREAM_LIMIT, KVLayout, PeerGone, read_frame, write_frame
from runtime.managers.disagg_hooks import DisaggQueues
from runtime.managers.io_struct import BootstrapInfo
from runtime.managers.req import FinishReason, Req

if TYPE_CHECKING:
    from runtime.managers.scheduler import Scheduler

log = structlog.get_logger("sluice.disaggregation")
REAP_INTERVAL = 0.5


@dataclass(eq=False, slots=True)
class Reservation:
    req: Req
    peer: Peer
    row: int
    slots: torch.Tensor
    deadline: float
    order: RankOrder | None = None  # the other TP ranks' part (tp_size > 1)
    header: dict[str, Any] | None = None  # the `kv` frame, once this rank's part is in place
    receiving: bool = False  # the KV is being scattered into `slots`
    ended: bool = False  # the request ended meanwhile: free when every scatter is done
    freed: bool = False


class DecodeDisaggregation:
    mode = "decode"

    def __init__(
        self, scheduler: Scheduler, buffers: list[torch.Tensor], layout: KVLayout, settings: EngineSettings, ranks: RankHub | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.ranks = ranks  # the other TP ranks' receivers (tp_size > 1)
        self.buffers = buffers
        self.layout = layout
        self.backend = transfer_backend(settings)
        self.timeout = settings.disaggregation_timeout
        self.prealloc_queue = DecodePreallocQueue(scheduler)
        self.transfer_queue: dict[int, Reservation] = {}  # DecodeTransferQueue: room -> reservation
        self.ready: list[Reservation] = []  # KV in place, for the next poll
        self.peers: dict[tuple[str, int], Peer] = {}
        self.stats = DisaggStats()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="sluice-kv-scatter")
        self._tasks = Tasks()
        self._links = itertools.count(1)

    async def start(self) -> None:
        if self.ranks is not None:
            await self.ranks.start()
        self._tasks.spawn(self._reap())

    def close(self) -> None:
        self._tasks.cancel()
        for peer in self.peers.values():
            peer.close()
        if self.ranks is not None:
            self.ranks.close()
        self._pool.shutdown(wait=False)

    # ---- scheduler hooks -------------------------------------------------------------------
    def add(self, req: Req) -> bool:
        if req.bootstrap is None or req.bootstrap.is_fake or self.backend == "fake":
            return False  # this server prefills it itself
        self.prealloc_queue.append(req)
        req.trace.queued("prealloc")
        return True

    def abort(self, req: Req) -> bool:
        info = req.bootstrap
        if info is None:
            return False
        why = "the request was aborted on the decode server"
        if req in self.prealloc_queue:
            self.prealloc_queue.remove(req)
            self._peer(info).send({"op": "abort", "room": info.room, "message": why})
        elif (res := self.transfer_queue.get(info.room)) is not None and res.req is req:
            self._end(res, None, notify=why)
        elif (res := next((r for r in self.ready if r.req is req), None)) is not None:
            self.ready.remove(res)
            self._free(res)
        else:
            return False
        self.scheduler.finish(req, FinishReason("abort", message="aborted"))
        return True

    def hold(self, req: Req, kv_len: int) -> bool:
        # `req` frees its KV now: the prealloc queue's front may fit. Wake the loop, which
        # would otherwise sleep when this was the last running request.
        if self.prealloc_queue:
            self.scheduler.wake()
        return False

    def poll(self) -> tuple[list[Req], list[Req]]:
        self._prealloc()
        ready, self.ready = self.ready, []
        return [], [r.req for r in ready]

    def queues(self) -> DisaggQueues:
        return DisaggQueues("decode", prealloc=len(self.prealloc_queue), transfer=len(self.transfer_queue))

    def info(self) -> dict[str, Any]:
        return {"disaggregation_mode": "decode", **self.stats.info()}

    # ---- reservations ----------------------------------------------------------------------
    def _prealloc(self) -> None:
        s = self.scheduler
        admitted = s.running_batch.reqs + [r.req for r in self.transfer_queue.values()] + [r.req for r in self.ready]
        for req, row, slots in self.prealloc_queue.reserve(admitted):
            assert req.bootstrap is not None
            peer = self._peer(req.bootstrap)
            room = req.bootstrap.room
            res = self.transfer_queue[room] = Reservation(req, peer, row, slots, time.monotonic() + self.timeout)
            if self.ranks is not None:
                res.order = self.ranks.order({"op": "recv", "room": room, "link": peer.link}, slots, functools.partial(self._progress, res))
            req.trace.queued("transfer", kv_slots=slots.numel())
            peer.rooms.add(room)
            peer.send({"op": "prealloc", "room": room, "prompt_len": slots.numel()})

    def _free(self, res: Reservation) -> None:
        """Give back `res`'s row and slots, once no rank writes into them any more."""
        if res.freed or res.receiving or (res.order is not None and not res.order.settled.done()):
            return
        res.freed = True
        self.scheduler.allocator.free(res.slots)
        self.scheduler.req_to_token_pool.free(res.row)
        if res.req.req_pool_idx == res.row:
            res.req.req_pool_idx = None

    def _end(self, res: Reservation, reason: FinishReason | None, notify: str | None = None) -> None:
        """Take `res` out of the transfer queue and release it (after its scatter, if one
        is running); finish its request with `reason` unless the caller does."""
        room = res.req.bootstrap.room if res.req.bootstrap is not None else -1
        if self.transfer_queue.get(room) is res:
            del self.transfer_queue[room]
        res.peer.rooms.discard(room)
        if notify is not None:
            res.peer.send({"op": "abort", "room": room, "message": notify})
        res.req.req_pool_idx = None  # finish must not donate this KV: it is not (all) there
        res.ended = True
        if room in self.stats.started:
            self.stats.done(room, 0, False)
        if res.order is not None and self.ranks is not None:
            self.ranks.drop(res.order)
        self._free(res)
        if reason is not None:
            self.scheduler.finish(res.req, reason)

    # ---- the KV receiver -------------------------------------------------------------------
    def _on_kv(self, peer: Peer, header: dict[str, Any], payload: bytearray | None) -> None:
        room = int(header["room"])
        data: asyncio.Future[torch.Tensor] | None = None
        if peer.paired:  # post the receive now, in header order, even for a room we dropped
            assert peer.group is not None
            group = peer.group
            data = asyncio.get_running_loop().run_in_executor(group.recv_executor, group.recv, int(header["nbytes"]), int(header["tag"]))
        res = self.transfer_queue.get(room)
        if res is None or res.peer is not peer:
            if data is not None:
                data.add_done_callback(lambda f: f.exception())  # drained and dropped
            return
        res.receiving = True
        self.stats.start(room)
        self._tasks.spawn(self._receive(res, header, payload, data))

    async def _receive(self, res: Reservation, header: dict[str, Any], payload: bytearray | None, data: asyncio.Future[torch.Tensor] | None) -> None:
        room, error = int(header["room"]), None
        try:
            kv = await data if data is not None else payload_from_bytes(payload or bytearray())
            await asyncio.get_running_loop().run_in_executor(self._pool, scatter_kv, self.buffers, res.slots, kv)
        except Exception as exc:  # noqa: BLE001 - any failure ends the room
            error = f"receiving the KV of bootstrap_room {room} failed: {str(exc) or type(exc).__name__}"
        res.receiving = False
        if error is None:
            res.header = header
        elif not res.ended:
            self._end(res, peer_error(error), notify=error)
        self._progress(res)

    def _progress(self, res: Reservation) -> None:
        """After any part of `res` moved: free it if it ended, end it if a rank failed,
        complete it once its KV is in place on every rank."""
        order, room = res.order, int(res.req.bootstrap.room if res.req.bootstrap is not None else -1)
        if res.ended:
            self._free(res)
            return
        if order is not None and order.result.done() and (exc := order.result.exception()) is not None:
            why = f"receiving the KV of bootstrap_room {room} failed: {exc}"
            self._end(res, peer_error(why), notify=why)
            if order.link_down:  # reconnect (every rank) for the next request
                res.peer.close()
            return
        if res.header is None or res.receiving or (order is not None and not order.result.done()):
            return
        header = res.header
        self.stats.done(room, res.slots.numel() * self.layout.bytes_per_token + (order.nbytes if order else 0), True)
        del self.transfer_queue[room]
        res.peer.rooms.discard(room)
        adopt_prefill(res.req, header)
        res.peer.send({"op": "ack", "room": room})
        self.ready.append(res)
        self.scheduler.wake()

    # ---- connections to prefill servers ---------------------------------------------------
    def _peer(self, info: BootstrapInfo) -> Peer:
        peer = self.peers.get(info.addr)
        if peer is None or peer.closed:
            peer = self.peers[info.addr] = Peer(f"prefill server {info.host}:{info.port}", link=next(self._links))
            self._tasks.spawn(self._connect(peer, info.host, info.port))
        return peer

    async def _connect(self, peer: Peer, host: str, port: int) -> None:
        why, reached = "closed", False
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=STREAM_LIMIT), self.timeout)
            reached = True
            peer.local_host = writer.get_extra_info("sockname")[0]
            write_frame(writer, {"op": "hello", "backend": self.backend, "layout": self.layout.to_json()})
            reply, _ = await read_frame(reader)
            if reply["op"] == "refused":
                peer.refusal = str(reply.get("message"))
                log.error("prefill server refused this decode server", peer=peer.name, reason=peer.refusal)
            elif "store_port" in reply:
                await peer.join_pairing(self.backend, host, int(reply["store_port"]), self.timeout)
            if self.ranks is not None and "endpoints" in reply:  # rank r connects to the prefill server's rank r
                self.ranks.post({"op": "connect", "link": peer.link, "peer": reply["link"], "host": host, "endpoints": reply["endpoints"]})
            peer.connected(writer)
            while True:
                header, payload = await read_frame(reader)
                op, room = header["op"], int(header.get("room", -1))
                if op == "kv":
                    self._on_kv(peer, header, payload)
                elif op in ("error", "abort"):
                    res = self.transfer_queue.get(room)
                    if res is not None and res.peer is peer and not res.receiving:
                        self._end(res, peer_error(str(header.get("message") or f"the {peer.name} ended the request")))
        except (PeerGone, OSError, TimeoutError, RuntimeError) as exc:
            why = str(exc) or type(exc).__name__
        finally:
            peer.close()
            if self.ranks is not None:
                self.ranks.post({"op": "disconnect", "link": peer.link})
            if self.peers.get((host, port)) is peer:
                del self.peers[(host, port)]
            what = f"the {peer.name} went away ({why})" if reached else f"cannot reach the {peer.name}'s bootstrap port: {why}"
            for res in [r for r in self.transfer_queue.values() if r.peer is peer and not r.receiving]:
                self._end(res, peer_error(what))

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for room, res in list(self.transfer_queue.items()):
                if res.deadline < now and not res.receiving:
                    why = f"the KV of bootstrap_room {room} did not arrive within {self.timeout:g} s"
                    self._end(res, peer_error(why), notify=why)

