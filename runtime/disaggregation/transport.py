"""Moving one request's KV: gather it out of the pool, ship it, scatter it into slots.

The payload of a room is, for each KV buffer in `Worker.kv_buffers()` order, that
buffer's rows at the request's slots, as raw bytes in the pool's dtype: the layout
handshake guarantees both sides read it the same way.

Backends: `tcp` writes the payload on the bootstrap connection itself; `gloo` and
`nccl` open a two-rank torch.distributed group per connection (prefill = rank 0,
decode = rank 1; rendezvous on a TCPStore the prefill server hosts) and move it
with point-to-point send/recv, the header still going over the connection.
At tp_size > 1 each TP rank pair (prefill rank r, decode rank r) has a connection
of its own, with the same framing (runtime/disaggregation/rank_agent.py).
"""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, cast

import torch
import torch.distributed as dist


def gather_kv(buffers: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The payload for `slots`: one flat uint8 tensor on the buffers' device."""
    idx = slots.to(buffers[0].device, torch.int64)
    return torch.cat([b.index_select(0, idx).reshape(-1).view(torch.uint8) for b in buffers])


def scatter_kv(buffers: list[torch.Tensor], slots: torch.Tensor, payload: torch.Tensor) -> None:
    """Write a payload made by `gather_kv` (same layout) into `slots`."""
    idx = slots.to(buffers[0].device, torch.int64)
    n, offset = idx.numel(), 0
    payload = payload.to(buffers[0].device)
    for b in buffers:
        size = n * b[0].numel() * b.element_size()
        rows = payload[offset : offset + size].view(b.dtype).view(n, *b.shape[1:])
        b.index_copy_(0, idx, rows)
        offset += size
    assert offset == payload.numel(), f"payload of {payload.numel()} bytes for {offset} bytes of KV"


def payload_from_bytes(data: bytearray) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(data, dtype=torch.uint8)


def as_memoryview(payload: torch.Tensor) -> memoryview:
    return payload.cpu().numpy().data.cast("B")


class _PointToPoint(Protocol):
    """What a backend process group does for us (torch's stubs put it on the base class only)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...


class PairGroup:
    """A two-rank torch.distributed group between one prefill server (rank 0) and one
    decode server (rank 1). Sends and receives each run on their own single thread, in
    the order the rooms' headers go over the connection, so tags always match."""

    def __init__(self, backend: str, store: dist.Store, rank: int, local_host: str, timeout: float, device: torch.device | None = None) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        if backend == "nccl":  # on the KV pool's GPU (`device`), else the current one
            self.device = device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        prefixed = dist.PrefixStore("sluice-pd", store)
        self.pg: _PointToPoint
        if backend == "gloo":
            opts = dist.ProcessGroupGloo.__dict__["_Options"]()  # private in torch's stubs, public in its API
            opts._timeout = datetime.timedelta(seconds=timeout)
            # The address this side reached (or was reached by) the peer on: the one
            # interface both know works.
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            self.pg = cast(_PointToPoint, dist.ProcessGroupGloo(prefixed, rank, 2, opts))
        elif backend == "nccl":
            self.pg = cast(_PointToPoint, dist.ProcessGroupNCCL(prefixed, rank, 2, dist.ProcessGroupNCCL.Options()))
        else:
            raise ValueError(f"no pair group for backend {backend!r}")
        self._send = ThreadPoolExecutor(1, thread_name_prefix="sluice-kv-send")
        self._recv = ThreadPoolExecutor(1, thread_name_prefix="sluice-kv-recv")
        self.store = store  # the prefill side hosts it: keep it alive as long as the group

    @staticmethod
    def host_store(host: str, timeout: float) -> dist.TCPStore:
        """The prefill side's rendezvous store, on a free port of `host`."""
        return dist.TCPStore(host, 0, 2, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)

    @staticmethod
    def join_store(host: str, port: int, timeout: float) -> dist.TCPStore:
        return dist.TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=timeout))

    def send(self, payload: torch.Tensor, tag: int) -> None:
        """Blocking; run it on `send_executor`."""
        self.pg.send([payload.to(self.device)], 1 - self.rank, tag).wait()

    def recv(self, nbytes: int, tag: int) -> torch.Tensor:
        """Blocking; run it on `recv_executor`."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.pg.recv([buf], 1 - self.rank, tag).wait()
        return buf

    @property
    def send_executor(self) -> ThreadPoolExecutor:
        return self._send

    @property
    def recv_executor(self) -> ThreadPoolExecutor:
        return self._recv

    def close(self) -> None:
        self._send.shutdown(wait=False, cancel_futures=True)
        self._recv.shutdown(wait=False, cancel_futures=True)
