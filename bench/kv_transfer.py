"""KV transfer throughput of the prefill/decode backends over loopback, against a plain
socket copy of the same bytes (the local limit).

For each payload size (one request's KV: tokens x bytes per token of the model's
layout), this times in one process with two threads:
  socket  one sendall of the bytes into a connected loopback socket, recv_into on the other side
  tcp     the same over asyncio streams with the bootstrap connection's framing (write_frame +
          read_frame, as the tcp backend ships a room), plus scatter into a KV buffer
  gloo    a two-rank gloo PairGroup send/recv (as the gloo backend), plus scatter
Each is the best of --repeats; GB/s = payload bytes / seconds.

    sluice bench kv-transfer [--tokens 128 1024 4096] [--bytes-per-token 92160] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096])
    # SmolLM2-135M in float32: 30 layers x (K + V) x 3 KV heads x 64 dims x 4 bytes.
    parser.add_argument("--bytes-per-token", type=int, default=30 * 2 * 3 * 64 * 4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-file", default=None)


def _socket_copy(nbytes: int) -> float:
    a, b = socket.socketpair()
    data, buf = bytes(nbytes), bytearray(nbytes)

    def receive() -> None:
        view, got = memoryview(buf), 0
        while got < nbytes:
            got += b.recv_into(view[got:])

    t0 = time.perf_counter()
    reader = threading.Thread(target=receive)
    reader.start()
    a.sendall(data)
    reader.join()
    dt = time.perf_counter() - t0
    a.close()
    b.close()
    return dt


def _tcp_frames(nbytes: int, bytes_per_token: int) -> float:
    import torch

    from runtime.disaggregation.transport import as_memoryview, payload_from_bytes, scatter_kv
    from runtime.disaggregation.wire import STREAM_LIMIT, read_frame, write_frame, write_payload

    tokens = nbytes // bytes_per_token
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    kv = torch.zeros((tokens + 1, bytes_per_token // 4), dtype=torch.float32)
    slots = torch.arange(1, tokens + 1)

    async def run() -> float:
        done: asyncio.Future[float] = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            _, data = await read_frame(reader)
            scatter_kv([kv], slots, payload_from_bytes(data or bytearray()))
            done.set_result(time.perf_counter())
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0, limit=STREAM_LIMIT)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port, limit=STREAM_LIMIT)
        t0 = time.perf_counter()
        view = as_memoryview(payload)
        write_frame(writer, {"op": "kv", "room": 1}, view.nbytes)
        await write_payload(writer, view)
        t1 = await done
        writer.close()
        server.close()
        return t1 - t0

    return asyncio.run(run())


def _gloo(nbytes: int, bytes_per_token: int) -> float:
    import torch

    from runtime.disaggregation.transport import PairGroup, scatter_kv

    tokens = nbytes // bytes_per_token
    store = PairGroup.host_store("127.0.0.1", 30)
    groups: dict[int, PairGroup] = {}

    def make(rank: int) -> None:
        st = store if rank == 0 else PairGroup.join_store("127.0.0.1", store.port, 30)
        groups[rank] = PairGroup("gloo", st, rank, "127.0.0.1", 30)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    kv = torch.zeros((tokens + 1, bytes_per_token // 4), dtype=torch.float32)
    slots = torch.arange(1, tokens + 1)
    t0 = time.perf_counter()
    sender = threading.Thread(target=groups[0].send, args=(payload, 7))
    sender.start()
    scatter_kv([kv], slots, groups[1].recv(nbytes, 7))
    sender.join()
    dt = time.perf_counter() - t0
    for g in groups.values():
        g.close()
    return dt


def main(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for tokens in args.tokens:
        nbytes = tokens * args.bytes_per_token
        for name, fn in (("socket", lambda: _socket_copy(nbytes)), ("tcp", lambda: _tcp_frames(nbytes, args.bytes_per_token)),
                         ("gloo", lambda: _gloo(nbytes, args.bytes_per_token))):
            best = min(fn() for _ in range(args.repeats))
            row = {"tokens": tokens, "mib": round(nbytes / 2**20, 1), "path": name, "ms": round(best * 1e3, 2),
                   "gb_per_s": round(nbytes / best / 1e9, 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.output_file:
        with open(args.output_file, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0
