"""Prefill/decode disaggregation end to end: a prefill server, a decode server and the
real sglang-router in `--pd-disaggregation` mode, all real processes on 127.0.0.1,
with each KV transfer backend.

Greedy outputs through the router equal one plain server's for the same prompts,
on every route, streamed or not; and after traffic with cancellations both servers
have every KV slot and row free.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from server_helpers import (
    MODEL,
    RouterProcess,
    ServerProcess,
    free_port,
    shared_server,
    sse_payloads,
)

pytestmark = pytest.mark.slow  # starts servers and routers

MAX_TOKENS = 12
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Rule 1: the keeper of lock 1 opens the sluice at six, logs the level, and closes it at dusk.\n" * 6 + "Who opens it?",
)
CHATS = ("Write a haiku about the sea.", "What is 2 + 2?")


@dataclass(frozen=True)
class PDCluster:
    prefill: ServerProcess
    decode: ServerProcess
    router: RouterProcess
    bootstrap_port: int


@contextlib.contextmanager
def pd_cluster(backend: str) -> Iterator[PDCluster]:
    with contextlib.ExitStack() as stack:
        bootstrap_port = free_port()
        common = ("--disaggregation-transfer-backend", backend, "--disaggregation-timeout", "30")
        prefill = ServerProcess("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port), *common)
        decode = ServerProcess("--disaggregation-mode", "decode", *common)
        for server in (prefill, decode):
            stack.callback(server.stop)
            server.start()
        for server in (prefill, decode):
            server.wait_ready()
        router = RouterProcess(
            "--pd-disaggregation", "--prefill", prefill.base_url, str(bootstrap_port), "--decode", decode.base_url,
            "--policy", "round_robin",
        )
        stack.callback(router.stop)
        router.start().wait_workers_healthy(2)
        yield PDCluster(prefill, decode, router, bootstrap_port)


@pytest.fixture(scope="module", params=["tcp", "gloo"])
def cluster(request: pytest.FixtureRequest) -> Iterator[PDCluster]:
    with pd_cluster(request.param) as c:
        yield c


@pytest.fixture(scope="module")
def fake_cluster() -> Iterator[PDCluster]:
    with pd_cluster("fake") as c:
        yield c


def _openai(base_url: str, route: str, body: dict[str, Any], stream: bool) -> tuple[str, str]:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream, **body}
    r = httpx.post(f"{base_url}{route}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    chat = route.endswith("/chat/completions")
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"], choice["finish_reason"]
    events = sse_payloads(r)
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for e in events for c in e["choices"])
    return text, [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]][-1]


def _generate(base_url: str, text: str, stream: bool) -> tuple[str, str]:
    body = {"text": text, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}, "stream": stream}
    r = httpx.post(f"{base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json() if not stream else sse_payloads(r)[-1]
    return out["text"], out["meta_info"]["finish_reason"]["type"]


def _all_routes(base_url: str, stream: bool) -> list[tuple[str, str]]:
    return (
        [_openai(base_url, "/v1/completions", {"prompt": p}, stream) for p in PROMPTS]
        + [_openai(base_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": c}]}, stream) for c in CHATS]
        + [_generate(base_url, p, stream) for p in PROMPTS]
    )


@functools.cache
def _one_server(base_url: str, stream: bool) -> list[tuple[str, str]]:
    """_all_routes on one plain server: the reference, asked once per server and mode."""
    return _all_routes(base_url, stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_outputs_through_the_pd_router_equal_one_server(cluster: PDCluster, stream: bool) -> None:
    assert _all_routes(cluster.router.base_url, stream) == _one_server(shared_server().base_url, stream)
    info = cluster.decode.server_info()
    assert info["kv_transfers_total"] > 0 and info["kv_transfer_bytes_total"] > 0
    assert info["disaggregation_mode"] == "decode" and cluster.prefill.server_info()["disaggregation_mode"] == "prefill"


def test_penalties_on_the_decode_server_see_the_prefilled_history(cluster: PDCluster) -> None:
    # The decode server never ran this prompt: its penalty state for the row must be
    # rebuilt from the prompt and the first token, or the outputs drift from one server's.
    body = {"prompt": PROMPTS[1], "max_tokens": 24, "frequency_penalty": 1.5, "presence_penalty": 0.5,
            "repetition_penalty": 1.3, "min_tokens": 20}
    single = shared_server().base_url
    penalized = _openai(single, "/v1/completions", body, False)
    assert penalized != _openai(single, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 24}, False)
    assert _openai(cluster.router.base_url, "/v1/completions", body, False) == penalized


def test_parallel_sampling_pairs_every_choice(cluster: PDCluster) -> None:
    # n = 2 through the router: one room for the request, room + i for choice i on both sides.
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "n": 2}
    r = httpx.post(f"{cluster.router.base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts[0] == texts[1] == _openai(shared_server().base_url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6}, False)[0]


def test_fake_backend_completes_requests(fake_cluster: PDCluster) -> None:
    assert _all_routes(fake_cluster.router.base_url, False) == _one_server(shared_server().base_url, False)
    assert fake_cluster.decode.server_info()["kv_transfers_total"] == 0  # the decode server prefilled itself


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_request_without_bootstrap_fields_is_a_400(cluster: PDCluster, side: str) -> None:
    server = cluster.prefill if side == "prefill" else cluster.decode
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 400, r.text
    assert "bootstrap_room" in r.json()["error"]["message"]


def test_metrics_show_the_queues_and_the_transfers(cluster: PDCluster) -> None:
    _generate(cluster.router.base_url, PROMPTS[0], False)
    decode = httpx.get(f"{cluster.decode.base_url}/metrics", timeout=10).text
    prefill = httpx.get(f"{cluster.prefill.base_url}/metrics", timeout=10).text
    for name in ("sglang:num_decode_prealloc_queue_reqs", "sglang:num_decode_transfer_queue_reqs"):
        assert name in decode
    assert "sglang:num_prefill_bootstrap_queue_reqs" in prefill
    sent = [float(line.split()[-1]) for line in prefill.splitlines() if line.startswith("sglang:kv_transfer_bytes_total")]
    assert sent and sent[0] > 0


async def _one(client: httpx.AsyncClient, i: int, cancel: bool) -> bool:
    """A streamed completion; `cancel` drops the connection after the second event."""
    body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 48, "temperature": 0.8, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = 0
        async for line in r.aiter_lines():
            events += line.startswith("data:")
            if cancel and events == 2:
                return False  # leaving the block closes the connection mid-stream
    return True


def test_cancelled_streams_leave_every_slot_free_on_both_sides(cluster: PDCluster) -> None:
    rng = random.Random(0)
    cancels = [rng.random() < 0.3 for _ in range(32)]

    async def main() -> list[bool]:
        async with httpx.AsyncClient(base_url=cluster.router.base_url, timeout=180) as client:
            return list(await asyncio.gather(*(_one(client, i, c) for i, c in enumerate(cancels))))

    finished = asyncio.run(main())
    assert sum(finished) == cancels.count(False)
    for server in (cluster.prefill, cluster.decode):
        info = server.wait_all_kv_free()
        assert info["available_kv_tokens"] == info["max_total_num_tokens"], info
        assert info["req_pool_free_rows"] == info["req_pool_size"], info
        assert info["num_prefill_bootstrap_queue_reqs"] == info["num_decode_transfer_queue_reqs"] == 0, info


def test_a_kv_dtype_mismatch_is_a_clear_503_on_both_sides(cluster: PDCluster) -> None:
    decode = ServerProcess("--disaggregation-mode", "decode", "--kv-cache-dtype", "bfloat16",
                           "--disaggregation-transfer-backend", _backend(cluster))
    try:
        decode.start().wait_ready()
        body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": cluster.bootstrap_port, "bootstrap_room": 4242}

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return list(await asyncio.gather(
                    client.post(f"{cluster.prefill.base_url}/generate", json=body),
                    client.post(f"{decode.base_url}/generate", json=body),
                ))

        for r in asyncio.run(both()):
            assert r.status_code == 503, r.text
            assert "KV cache dtype differs" in r.json()["error"]["message"]
        info = decode.wait_all_kv_free()
        assert info["available_kv_tokens"] == info["max_total_num_tokens"]
    finally:
        decode.stop()


def _backend(cluster: PDCluster) -> str:
    return str(cluster.decode.cmd[cluster.decode.cmd.index("--disaggregation-transfer-backend") + 1])
