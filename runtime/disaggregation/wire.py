"""The bootstrap connection's messages, and the KV layout both sides must share.

One TCP connection per (decode server, prefill server) pair, opened by the decode
side to the prefill server's bootstrap port, carries every room between them. A
frame is a 4-byte big-endian length, an orjson header, then `header["nbytes"]` raw
bytes when the header says so (the KV of the `tcp` backend).

Decode -> prefill: `hello` (first frame: backend, layout), `prealloc` (a room's
slots are reserved: send its KV), `ack` (a room's KV is in place), `abort`.
Prefill -> decode: `hello_ok` / `refused` (the layouts differ: every room on this
connection will be refused with that message), `kv` (a room's first token and KV),
`error` (a room failed on the prefill side), `abort`.

At tp_size > 1 `hello_ok` also carries `link` (this connection's id) and `endpoints`
(per TP rank, where that rank's KV sender listens; host None = the bootstrap host).
Decode rank r then opens a connection of the same framing to prefill rank r:
`hello` (peer = link, rank, backend, layout), `hello_ok` / `refused`, then `kv`
frames (room and KV only) from prefill to decode (rank_agent.py).
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import torch

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20
# StreamReader buffer limit of a bootstrap connection. asyncio's default (64 KiB) pauses
# the socket every 128 KiB: a 45 MiB KV payload then crawls at a tenth of a plain
# socket copy (bench/RESULTS.md, kv-transfer).
STREAM_LIMIT = 1 << 26


class PeerGone(ConnectionError):
    """The bootstrap connection closed or sent garbage."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What must be equal on both sides for one side's KV slots to mean the same on the other."""

    model: str  # architecture and shape of the model
    page_size: int
    dtype: str  # the KV pool's dtype
    slot_shapes: tuple[tuple[int, ...], ...]  # per KV buffer, one slot's shape (this TP rank's heads)
    # TP rank r sends its heads to the peer's rank r: both sides split the heads alike.
    tp_size: int = 1

    @staticmethod
    def of(model: str, page_size: int, buffers: list[torch.Tensor], tp_size: int = 1) -> KVLayout:
        dtypes = {str(b.dtype).removeprefix("torch.") for b in buffers}
        assert len(dtypes) == 1, f"KV buffers of mixed dtypes: {dtypes}"
        return KVLayout(model, page_size, dtypes.pop(), tuple(tuple(b.shape[1:]) for b in buffers), tp_size)

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return sum(itemsize * _prod(s) for s in self.slot_shapes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> KVLayout:
        slot_shapes = tuple(tuple(s) for s in d["slot_shapes"])
        return KVLayout(str(d["model"]), int(d["page_size"]), str(d["dtype"]), slot_shapes, int(d.get("tp_size", 1)))

    def mismatch(self, other: KVLayout) -> str | None:
        """Why `other` (the peer's) cannot exchange KV with this one, or None."""
        if self.tp_size != other.tp_size:  # first: it also changes the slot shapes
            return (f"tp_size differs: this server has {self.tp_size}, the peer has {other.tp_size} "
                    "(prefill and decode servers must run the same --tp-size)")
        for name in ("model", "page_size", "dtype", "slot_shapes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                label = {"dtype": "KV cache dtype", "slot_shapes": "KV slot shapes"}.get(name, name)
                return f"{label} differs: this server has {mine}, the peer has {theirs}"
        return None


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytearray | None]:
    """One header, and its payload if it announces one. Raises PeerGone at EOF."""
    try:
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if n > MAX_HEADER:
            raise PeerGone(f"header of {n} bytes")
        header = orjson.loads(await reader.readexactly(n))
        nbytes = header.get("nbytes")
        payload = await _read_payload(reader, int(nbytes)) if nbytes is not None and header.get("inline") else None
    except (asyncio.IncompleteReadError, ConnectionError, orjson.JSONDecodeError) as exc:
        raise PeerGone(str(exc) or type(exc).__name__) from exc
    if not isinstance(header, dict) or "op" not in header:
        raise PeerGone("malformed frame")
    return header, payload


CHUNK = 1 << 22  # a large payload moves in pieces: no whole-payload copies in asyncio's buffers


async def _read_payload(reader: asyncio.StreamReader, nbytes: int) -> bytearray:
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        chunk = await reader.read(min(nbytes - got, CHUNK))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:got]), nbytes)
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    return buf


def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any], payload_nbytes: int | None = None) -> None:
    """Queue one frame's header on `writer`; with `payload_nbytes`, the caller writes
    that many payload bytes next (write_payload)."""
    if payload_nbytes is not None:
        header = {**header, "nbytes": payload_nbytes, "inline": True}
    data = orjson.dumps(header)
    writer.write(_LEN.pack(len(data)) + data)


async def write_payload(writer: asyncio.StreamWriter, payload: memoryview) -> None:
    for start in range(0, payload.nbytes, CHUNK):
        writer.write(payload[start : start + CHUNK])
        await writer.drain()
