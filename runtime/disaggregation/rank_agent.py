"""A worker TP rank's KV transfer agent (prefill/decode disaggregation at tp_size > 1).

Rank 0 decides (ranks.py); this agent, on rank r > 0, moves rank r's heads. It
runs its own asyncio loop on a daemon thread: the rank's step loop only hands it
side messages (`post`, which never blocks) and goes back to its forwards.

Prefill rank r listens for decode rank r's connection (its endpoint was registered
with the bootstrap server through rank 0's hub) and, for each `send` order, gathers
its heads of the room's slots and ships them on that connection (tcp inline; gloo
and nccl on a two-rank group of the pair, as the bootstrap connection does).
Decode rank r connects to prefill rank r on `connect` and scatters each room it
receives into the slots its `recv` order names (KV that comes first waits for it).

Invariant: every order gets exactly one report to rank 0 (done, failed or dropped),
and none while this rank still reads (gather) or writes (scatter) its slots.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from config.settings import EngineSettings
from runtime.disaggregation.common import Tasks, transfer_backend
from runtime.disaggregation.peer import Peer, refusal
from runtime.disaggregation.transport import gather_kv, payload_from_bytes, scatter_kv
from runtime.disaggregation.wire import STREAM_LIMIT, KVLayout, PeerGone, read_frame, write_frame
from runtime.model_executor.tp_channel import SideMessage

log = structlog.get_logger("sluice.disaggregation")
LINK_ERRORS = (PeerGone, OSError, TimeoutError, RuntimeError)


@dataclass(eq=False, slots=True)
class Job:
    """One order: this rank's part of one room's transfer."""

    oid: int
    room: int
    link: int  # Peer.link of the room's bootstrap connection, as this server's rank 0 numbers it
    slots: torch.Tensor
    busy: bool = False  # gathering from / scattering into `slots`
    dropped: bool = False
    reported: bool = False


class RankAgent:
    def __init__(self, rank: int, settings: EngineSettings, buffers: list[torch.Tensor]) -> None:
        self.rank = rank
        self.settings = settings
        self.buffers = buffers
        self.backend = transfer_backend(settings)
        self.timeout = settings.disaggregation_timeout
        self.layout: KVLayout | None = None  # from the setup order (the model string is rank 0's)
        self.jobs: dict[int, Job] = {}
        self.links: dict[int, Peer] = {}  # link id -> connection to the peer server's rank r
        self.gone: set[int] = set()  # links closed for good: their orders fail at once
        self.waiting: dict[tuple[int, int], Job] = {}  # decode: (link, room) -> order awaiting its KV
        self.early: dict[tuple[int, int], tuple[asyncio.Future[torch.Tensor], float]] = {}  # KV before its order
        self._changed = asyncio.Event()
        self._hub = Peer("rank 0's hub")  # reports queue until connected
        self._server: asyncio.Server | None = None
        self._copy = ThreadPoolExecutor(1, thread_name_prefix="sluice-kv-copy")
        self._tasks = Tasks()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"sluice-kv-agent{rank}", daemon=True)
        self._thread.start()

    def post(self, message: SideMessage) -> None:
        """From the step loop: handled on the agent's thread, in posting order."""
        self.loop.call_soon_threadsafe(self._on_message, message)

    def close(self) -> None:
        """Stop the agent's connections, tasks and thread (at shutdown)."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self._close)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()

    def _close(self) -> None:
        self._tasks.cancel()
        for link in list(self.links.values()):
            link.close()
        self._hub.close()
        if self._server is not None:
            self._server.close()
        self._copy.shutdown(wait=False)
        self.loop.call_soon(self.loop.stop)  # after the cancellations have run

    def _on_message(self, message: SideMessage) -> None:
        h, op = message.header, message.header["op"]
        if op == "setup":
            self.layout = KVLayout.of(h["model"], self.settings.page_size, self.buffers, self.settings.tp_size)
            self._tasks.spawn(self._setup(h["hub"][0], int(h["hub"][1])))
        elif op == "send":
            job = self.jobs[h["oid"]] = Job(h["oid"], h["room"], h["link"], message.slots)
            self._tasks.spawn(self._send(job))
        elif op == "recv":
            self._on_recv(Job(h["oid"], h["room"], h["link"], message.slots))
        elif op == "drop" and (ended := self.jobs.get(h["oid"])) is not None:
            ended.dropped = True
            if self.waiting.get((ended.link, ended.room)) is ended:
                del self.waiting[(ended.link, ended.room)]
            if not ended.busy:
                self._report(ended, "dropped")
        elif op == "connect":
            host, port = h["endpoints"][self.rank]
            self._tasks.spawn(self._connect(h["link"], h["peer"], host or h["host"], int(port)))
        elif op == "disconnect" and (link := self.links.get(h["link"])) is not None:
            link.close()  # its reader ends, and with it the orders bound to it

    def _report(self, job: Job, error: str | None = None, nbytes: int = 0, link_down: bool = False) -> None:
        if not job.reported:
            job.reported = True
            self.jobs.pop(job.oid, None)
            self._hub.send({"op": "report", "oid": job.oid, "error": error, "nbytes": nbytes, "link_down": link_down})

    def _links_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _setup(self, host: str, port: int) -> None:
        endpoint: list[Any] | None = None
        reader, writer = await asyncio.open_connection(host, port)
        if self.settings.disaggregation_mode == "prefill":
            # All interfaces, as the bootstrap server. A rank on node 0 is reached at the
            # bootstrap host (None); one elsewhere at its address toward node 0.
            self._server = await asyncio.start_server(self._serve, host="0.0.0.0", port=0, limit=STREAM_LIMIT)
            same_node = self.rank < self.settings.tp_size // self.settings.nnodes
            endpoint = [None if same_node else writer.get_extra_info("sockname")[0], self._server.sockets[0].getsockname()[1]]
        write_frame(writer, {"op": "hello", "rank": self.rank, "endpoint": endpoint})
        self._hub.connected(writer)
        await reader.read()  # the hub never writes: this returns when rank 0 goes
        self._hub.close()

    # ---- prefill rank r: the KV sender ---------------------------------------------------
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        local_host, addr = writer.get_extra_info("sockname")[0], writer.get_extra_info("peername")
        link = Peer(f"decode server {addr[0]}:{addr[1]} (tp rank {self.rank})", writer, local_host)
        peer_id = -1
        try:
            hello, _ = await read_frame(reader)
            peer_id = int(hello["peer"])
            assert self.layout is not None
            why = refusal(self.layout, self.backend, hello)
            if int(hello["rank"]) != self.rank:
                why = f"decode tp rank {hello['rank']} reached prefill tp rank {self.rank}"
            if why is not None:
                link.send({"op": "refused", "message": why})
                return
            await link.accept_pairing(self.backend, self.timeout, {"op": "hello_ok"}, self.buffers[0].device)
            self.links[peer_id] = link
            self._links_changed()
            await reader.read()  # the decode rank sends nothing more: until it closes
        except LINK_ERRORS as exc:
            log.warning("decode rank connection failed", rank=self.rank, peer=peer_id, error=str(exc))
        finally:
            link.close()
            if self.links.get(peer_id) is link:
                del self.links[peer_id]
            if peer_id >= 0 and peer_id not in self.links:
                self.gone.add(peer_id)
                self._links_changed()

    async def _link(self, peer_id: int) -> Peer:
        while (link := self.links.get(peer_id)) is None:
            if peer_id in self.gone:
                raise PeerGone(f"the decode server's tp rank {self.rank} went away")
            await self._changed.wait()
        return link

    async def _send(self, job: Job) -> None:
        try:
            job.busy = True
            payload = await self.loop.run_in_executor(self._copy, self._read, job.slots)
            job.busy = False
            if job.dropped:
                self._report(job, "dropped")
                return
            link = await asyncio.wait_for(self._link(job.link), self.timeout)
            if job.dropped:  # (already reported) while the decode rank was not there yet
                return
            await link.send_kv({"op": "kv", "room": job.room}, payload)
            self._report(job, None, payload.numel())
        except Exception as exc:  # noqa: BLE001 - every failure is reported to rank 0
            job.busy = False
            why = str(exc) or type(exc).__name__
            self._report(job, f"sending its KV of bootstrap_room {job.room} failed: {why}", link_down=isinstance(exc, LINK_ERRORS))

    # ---- decode rank r: the KV receiver --------------------------------------------------
    async def _connect(self, key: int, peer_id: int, host: str, port: int) -> None:
        link = self.links[key] = Peer(f"prefill server {host}:{port} (tp rank {self.rank})")
        why = "closed"
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=STREAM_LIMIT), self.timeout)
            link.local_host = writer.get_extra_info("sockname")[0]
            link.writer = writer  # closed with the link
            assert self.layout is not None
            write_frame(writer, {"op": "hello", "peer": peer_id, "rank": self.rank, "backend": self.backend, "layout": self.layout.to_json()})
            reply, _ = await read_frame(reader)
            if reply["op"] == "refused":
                raise PeerGone(f"refused: {reply.get('message')}")
            if "store_port" in reply:
                await link.join_pairing(self.backend, host, int(reply["store_port"]), self.timeout, self.buffers[0].device)
            while True:
                header, payload = await read_frame(reader)
                if header["op"] == "kv":
                    self._on_kv(key, link, header, payload)
        except LINK_ERRORS as exc:
            why = str(exc) or type(exc).__name__
        finally:
            link.close()
            if self.links.get(key) is link:
                del self.links[key]
            self.gone.add(key)
            for job in [j for (k, _), j in self.waiting.items() if k == key]:
                del self.waiting[(key, job.room)]
                self._report(job, f"its connection to the {link.name} went away ({why})", link_down=True)
            for entry in [e for e in self.early if e[0] == key]:
                self._discard(self.early.pop(entry)[0])

    def _on_kv(self, key: int, link: Peer, header: dict[str, Any], payload: bytearray | None) -> None:
        data: asyncio.Future[torch.Tensor]
        if link.paired:  # post the receive now, in header order, even for a room dropped here
            assert link.group is not None
            group = link.group
            data = self.loop.run_in_executor(group.recv_executor, group.recv, int(header["nbytes"]), int(header["tag"]))
        else:
            data = self.loop.create_future()
            data.set_result(payload_from_bytes(payload or bytearray()))
        room = int(header["room"])
        job = self.waiting.pop((key, room), None)
        if job is not None:
            self._tasks.spawn(self._scatter(job, data))
            return
        now = time.monotonic()
        for entry in [e for e, (_, deadline) in self.early.items() if deadline < now]:
            self._discard(self.early.pop(entry)[0])
        self.early[(key, room)] = (data, now + self.timeout)

    def _on_recv(self, job: Job) -> None:
        self.jobs[job.oid] = job
        early = self.early.pop((job.link, job.room), None)
        if early is not None:
            self._tasks.spawn(self._scatter(job, early[0]))
        elif job.link in self.gone:
            self._report(job, "its connection to the prefill server's rank went away", link_down=True)
        else:
            self.waiting[(job.link, job.room)] = job

    async def _scatter(self, job: Job, data: asyncio.Future[torch.Tensor]) -> None:
        try:
            kv = await data
            if job.dropped:
                self._report(job, "dropped")
                return
            job.busy = True
            await self.loop.run_in_executor(self._copy, self._write, job.slots, kv)
            job.busy = False
            self._report(job, "dropped" if job.dropped else None, kv.numel())
        except Exception as exc:  # noqa: BLE001 - every failure is reported to rank 0
            job.busy = False
            self._report(job, f"receiving its KV of bootstrap_room {job.room} failed: {str(exc) or type(exc).__name__}")

    def _read(self, slots: torch.Tensor) -> torch.Tensor:
        if self.buffers[0].is_cuda:  # the step that wrote them may still run on the device
            torch.cuda.synchronize(self.buffers[0].device)
        return gather_kv(self.buffers, slots)

    def _write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        scatter_kv(self.buffers, slots, kv)
        if self.buffers[0].is_cuda:  # in the pool before rank 0 hears of it
            torch.cuda.current_stream(self.buffers[0].device).synchronize()

    @staticmethod
    def _discard(data: asyncio.Future[torch.Tensor]) -> None:
        data.add_done_callback(lambda f: f.cancelled() or f.exception())  # drained and dropped
