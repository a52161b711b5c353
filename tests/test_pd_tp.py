"""Prefill/decode disaggregation with tensor parallelism: a prefill server and a decode
server, each `sluice serve --tp-size 2` (rank 0 and one spawned rank, gloo on
loopback), paired as sglang-router pairs them (the same bootstrap fields to both).

- Greedy outputs of the decode server equal HF transformers on the same weights,
  with the tcp and gloo backends, KV heads split over the ranks (two heads, tcp) and
  replicated on both (one head, gloo); every rank moved its own heads (the bytes).
- A decode rank stopped mid-transfer, then the request aborted: both halves end,
  and once the rank resumes every slot and row is free on both servers, which go on
  serving HF's outputs.
- A decode rank killed mid-transfer: the prefill half ends with a 503 and the
  prefill server frees everything.
(A tp_size mismatch is refused at the handshake: tests/test_pd_stub.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import HFOracle, assert_greedy_equal
from tests.server_helpers import ServerProcess, free_port, poll_until
from tests.test_tp_server import _worker_ranks
from tests.tiny_checkpoints import make_llama_checkpoint

MAX_NEW = 8
HEAD_DIM, LAYERS, TP = 16, 2, 2  # tests/tiny_checkpoints.py
_rooms = itertools.count(1 << 40)


@dataclass
class Cluster:
    prefill: ServerProcess
    decode: ServerProcess
    bootstrap_port: int
    checkpoint: Path
    kv_heads: int
    backend: str
    decode_flags: tuple[str, ...]

    def live(self) -> Cluster:
        """This cluster, with a new decode server if a test took the last one down."""
        assert self.decode.proc is not None
        if self.decode.proc.poll() is not None:
            self.decode = ServerProcess(*self.decode_flags).start().wait_ready()
        return self

    def body(self, ids: list[int], max_new: int, room: int, **extra: Any) -> dict[str, Any]:
        params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        return {"input_ids": ids, "sampling_params": params, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port, "bootstrap_room": room, **extra}

    async def pair(self, client: httpx.AsyncClient, ids: list[int], max_new: int = MAX_NEW, decode: ServerProcess | None = None,
                   **extra: Any) -> tuple[httpx.Response, httpx.Response]:
        body = self.body(ids, max_new, next(_rooms), **extra)
        p, d = await asyncio.gather(client.post(f"{self.prefill.base_url}/generate", json=body),
                                    client.post(f"{(decode or self.decode).base_url}/generate", json=body))
        return p, d

    def assert_all_free(self) -> None:
        for server in (self.prefill, self.decode):
            assert_all_free(server)


def assert_all_free(server: ServerProcess) -> None:
    """Every KV slot and row free once requests ended and the cache is flushed. A room
    that ended while a rank still moved its KV frees its slots when that rank reports:
    poll for it."""

    def free() -> dict[str, Any] | None:
        info = server.wait_all_kv_free()
        slots_and_rows = info["available_kv_tokens"] == info["max_total_num_tokens"] and info["req_pool_free_rows"] == info["req_pool_size"]
        queues = info.get("num_decode_transfer_queue_reqs", 0) == info.get("num_prefill_inflight_queue_reqs", 0) == 0
        return info if slots_and_rows and queues else None

    poll_until(free, timeout=30, interval=0.2, what=f"every slot and row of {server.base_url} to be free")


def _stop(server: ServerProcess) -> None:
    """The server and every rank it spawned."""
    ranks = _worker_ranks(server.proc.pid) if server.proc is not None and server.proc.poll() is None else []
    server.stop()
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def pd_cluster(checkpoint: Path, kv_heads: int, backend: str) -> Iterator[Cluster]:
    port = free_port()
    common = ("--model-path", str(checkpoint), "--tp-size", str(TP), "--disaggregation-transfer-backend", backend,
              "--disaggregation-timeout", "20", "--dist-timeout", "120")  # a stopped rank must not kill the group
    prefill = ServerProcess("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port), *common)
    decode_flags = ("--disaggregation-mode", "decode", *common)
    cluster = Cluster(prefill, ServerProcess(*decode_flags), port, checkpoint, kv_heads, backend, decode_flags)
    try:
        for server in (prefill, cluster.decode):
            server.start()
        for server in (prefill, cluster.decode):
            server.wait_ready()
        yield cluster
    finally:
        for server in (prefill, cluster.decode):
            _stop(server)


@pytest.fixture(scope="module", params=[("tcp", 2), ("gloo", 1)], ids=["tcp-kv_heads_split", "gloo-kv_heads_replicated"])
def pd_tp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Iterator[Cluster]:
    backend, kv_heads = request.param
    checkpoint = make_llama_checkpoint(tmp_path_factory.mktemp(f"pd-tp-kv{kv_heads}"), tokenizer, num_kv_heads=kv_heads)
    with pd_cluster(checkpoint, kv_heads, backend) as cluster:
        yield cluster


def _ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    out: list[int] = r.json()["output_ids"]
    return out


def test_tp2_decode_outputs_equal_hf(pd_tp: Cluster, prompts: list[list[int]]) -> None:
    pd_tp = pd_tp.live()
    oracle = HFOracle(pd_tp.checkpoint)

    async def main() -> list[tuple[httpx.Response, httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(pd_tp.pair(client, p) for p in prompts)))

    before = pd_tp.decode.server_info()
    for prompt, (p, d) in zip(prompts, asyncio.run(main())):
        assert_greedy_equal(oracle, prompt, _ids(d), MAX_NEW)
        assert _ids(p) == _ids(d)[:1], "the prefill server answers with the first token"
    after = pd_tp.decode.server_info()
    assert after["kv_transfers_total"] - before["kv_transfers_total"] == len(prompts)
    # Every rank moved its own heads (float32): its share of a token's K and V, times TP ranks.
    per_rank_heads = max(1, pd_tp.kv_heads // TP)
    moved = after["kv_transfer_bytes_total"] - before["kv_transfer_bytes_total"]
    assert moved == sum(len(p) for p in prompts) * LAYERS * 2 * per_rank_heads * HEAD_DIM * 4 * TP
    pd_tp.assert_all_free()


def _queued(server: ServerProcess, key: str) -> bool:
    return bool(server.server_info()[key])


def test_an_abort_while_a_decode_rank_is_stopped_mid_transfer_frees_every_slot_on_both_sides(pd_tp: Cluster, prompts: list[list[int]]) -> None:
    pd_tp = pd_tp.live()
    assert pd_tp.decode.proc is not None
    (rank1,) = _worker_ranks(pd_tp.decode.proc.pid)
    prompt = prompts[-1]

    async def main() -> tuple[httpx.Response, httpx.Response, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            os.kill(rank1, signal.SIGSTOP)  # its part of the KV cannot land
            try:
                pair = asyncio.ensure_future(pd_tp.pair(client, prompt, rid="victim"))
                await asyncio.to_thread(poll_until, lambda: _queued(pd_tp.prefill, "num_prefill_inflight_queue_reqs"), 30)
                await asyncio.to_thread(poll_until, lambda: _queued(pd_tp.decode, "num_decode_transfer_queue_reqs"), 30)
                await client.post(f"{pd_tp.decode.base_url}/abort_request", json={"rid": "victim"})
                p, d = await asyncio.wait_for(pair, 30)  # both halves end with rank 1 still stopped
                held = await asyncio.to_thread(pd_tp.decode.wait_all_kv_free)
            finally:
                os.kill(rank1, signal.SIGCONT)
            return p, d, held

    p, d, held = asyncio.run(main())
    assert d.json()["meta_info"]["finish_reason"]["type"] == "abort", d.text
    assert p.status_code == 503 and "aborted on the decode server" in p.json()["error"]["message"], p.text
    # Rank 1 may still write the room's slots: rank 0 keeps them until it reports.
    assert held["available_kv_tokens"] == held["max_total_num_tokens"] - len(prompt), held
    pd_tp.assert_all_free()  # it reported once it resumed

    async def again() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await pd_tp.pair(client, prompt)

    _, d = asyncio.run(again())
    assert_greedy_equal(HFOracle(pd_tp.checkpoint), prompt, _ids(d), MAX_NEW)


def test_a_decode_rank_killed_mid_transfer_ends_the_prefill_half_and_frees_it(pd_tp: Cluster, prompts: list[list[int]]) -> None:
    # Last in this file: it takes the module's decode server down (a test after it would start another).
    pd_tp = pd_tp.live()
    assert pd_tp.decode.proc is not None
    (rank1,) = _worker_ranks(pd_tp.decode.proc.pid)

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=120) as client:
            os.kill(rank1, signal.SIGSTOP)
            pair = asyncio.ensure_future(pd_tp.pair(client, prompts[-1]))
            await asyncio.to_thread(poll_until, lambda: _queued(pd_tp.prefill, "num_prefill_inflight_queue_reqs"), 30)
            os.kill(rank1, signal.SIGKILL)  # the decode server's group is dead: it exits
            p, _ = await asyncio.wait_for(pair, 60)
            return p

    p = asyncio.run(main())
    # Whichever the prefill server sees first: the bootstrap connection gone, or its rank 1's send failing.
    assert p.status_code == 503 and "KV transfer of bootstrap_room" in p.json()["error"]["message"], p.text
    assert pd_tp.decode.wait_exit(60) != 0
    assert_all_free(pd_tp.prefill)
