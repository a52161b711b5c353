"""Data parallelism: two `sluice serve` replicas behind the real sglang-router (PyPI
`sglang-router`, the Rust load balancer) in regular mode with the cache-aware policy.

Everything is a real process on 127.0.0.1: the router registers the replicas through
the endpoints it probes (/health, /server_info, /model_info), forwards completions,
chat and /generate to them, and keeps requests that share a prefix on the replica
whose radix cache holds it. Every process is stopped when the module ends, also when
start-up fails half-way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from server_helpers import MODEL, RouterProcess, ServerProcess, sse_payloads

pytestmark = pytest.mark.slow  # starts two servers and the router

MAX_TOKENS = 12

# ~400 tokens shared by every prompt of the prefix-routing test; only the question differs.
SHARED_PREFIX = "".join(
    f"Rule {i}: the gate keeper of lock {i} opens the sluice at {6 + i % 5} o'clock, logs the water level "
    f"in ledger {chr(65 + i % 26)}, and closes it when the river drops below mark {i * 7 % 31}.\n"
    for i in range(1, 10)
)
QUESTIONS = ("Which ledger does lock 3 use?", "When does lock 7 open?", "What mark closes lock 2?",
             "Who opens the sluice?")


@dataclass(frozen=True)
class Cluster:
    replicas: tuple[ServerProcess, ServerProcess]
    router: RouterProcess

    @property
    def single(self) -> ServerProcess:
        """The replica queried directly: what one server alone answers."""
        return self.replicas[0]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        replicas = (ServerProcess(), ServerProcess())
        for replica in replicas:  # both load at once
            stack.callback(replica.stop)
            replica.start()
        for replica in replicas:
            replica.wait_ready()
        router = RouterProcess("--worker-urls", *[r.base_url for r in replicas], "--policy", "cache_aware")
        stack.callback(router.stop)
        router.start().wait_workers_healthy(len(replicas))
        yield Cluster(replicas, router)


def _counters(server: ServerProcess) -> dict[str, int]:
    info = server.server_info()
    return {k: int(info[k]) for k in ("num_requests_total", "cached_tokens_total", "prompt_tokens_total")}


# ------------------------------------------------------------- (c) start-up probes


def test_router_registers_both_replicas_healthy_over_http(cluster: Cluster) -> None:
    workers = {w["url"]: w for w in cluster.router.workers()}
    assert set(workers) == {r.base_url for r in cluster.replicas}
    for worker in workers.values():
        assert worker["is_healthy"] and worker["worker_type"] == "regular"
        assert worker["connection_mode"] == "HTTP"
        assert worker["model_id"] == MODEL  # read from the replica's /server_info
    # The router's own probes, which the Helm chart points Kubernetes at.
    assert httpx.get(f"{cluster.router.base_url}/liveness", timeout=5).status_code == 200
    assert httpx.get(f"{cluster.router.base_url}/readiness", timeout=5).json()["healthy_workers"] == 2
    models = httpx.get(f"{cluster.router.base_url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_every_worker_endpoint_the_router_probed_answered(cluster: Cluster) -> None:
    # sglang-router asks for /server_info and /model_info first and falls back to the
    # /get_ names on a 404, logging that it did; sluice serves both names.
    # Its only other complaint is that the replicas name no tokenizer path: it needs
    # one only for gRPC workers and its own /v1/tokenize, not to route HTTP.
    problems = [line for line in cluster.router.log().splitlines()
                if any(s in line for s in ("falling back", "returned 404", "Failed", " ERROR "))]
    assert not problems, "\n".join(problems)


def test_router_reads_each_replicas_load_report(cluster: Cluster) -> None:
    loads = httpx.get(f"{cluster.router.base_url}/get_loads", timeout=10).json()["workers"]
    assert {w["worker"] for w in loads} == {r.base_url for r in cluster.replicas}
    assert all(w["load"] >= 0 for w in loads), loads  # -1: the router could not read /get_load


def test_flush_cache_through_the_router_reaches_every_replica(cluster: Cluster) -> None:
    r = httpx.post(f"{cluster.router.base_url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["workers_flushed"] == 2
    for replica in cluster.replicas:
        info = replica.server_info()
        assert info["available_kv_tokens"] == info["max_total_num_tokens"]


# ------------------------------------------------- (a) outputs equal one server's

COMPLETION_PROMPTS = ("The capital of France is", "def fibonacci(n):", SHARED_PREFIX + "Which lock opens last?")
CHAT_MESSAGES = ("Write a haiku about the sea.", "What is 2 + 2?")


def _openai(base_url: str, route: str, body: dict[str, Any], stream: bool) -> tuple[str, str, int]:
    """(text, finish_reason, completion_tokens) of one greedy OpenAI request, streamed or not."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream, **body}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(f"{base_url}{route}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    chat = route.endswith("/chat/completions")
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"]
    events = sse_payloads(r)
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for e in events for c in e["choices"])
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    return text, finish[-1], events[-1]["usage"]["completion_tokens"]


def _completion(base_url: str, prompt: str, stream: bool) -> tuple[str, str, int]:
    return _openai(base_url, "/v1/completions", {"prompt": prompt}, stream)


def _chat(base_url: str, content: str, stream: bool) -> tuple[str, str, int]:
    return _openai(base_url, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}, stream)


def _generate(base_url: str, text: str, stream: bool) -> tuple[str, str, int]:
    body = {"text": text, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}, "stream": stream}
    r = httpx.post(f"{base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json() if not stream else sse_payloads(r)[-1]
    return out["text"], out["meta_info"]["finish_reason"]["type"], out["meta_info"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_completions_through_the_router_equal_one_server(cluster: Cluster, stream: bool) -> None:
    for prompt in COMPLETION_PROMPTS:
        routed = _completion(cluster.router.base_url, prompt, stream)
        assert routed == _completion(cluster.single.base_url, prompt, stream), prompt[-40:]
        assert routed[2] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_chat_through_the_router_equals_one_server(cluster: Cluster, stream: bool) -> None:
    for content in CHAT_MESSAGES:
        routed = _chat(cluster.router.base_url, content, stream)
        assert routed == _chat(cluster.single.base_url, content, stream), content
        assert routed[0] and routed[2] <= MAX_TOKENS


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_native_generate_through_the_router_equals_one_server(cluster: Cluster, stream: bool) -> None:
    for prompt in COMPLETION_PROMPTS[:2]:
        assert _generate(cluster.router.base_url, prompt, stream) == _generate(cluster.single.base_url, prompt, stream)


# ------------------------------------------------ (b) cache-aware prefix routing


def test_requests_sharing_a_long_prefix_land_on_one_replica_and_hit_its_cache(cluster: Cluster) -> None:
    tokenized = httpx.post(f"{cluster.single.base_url}/v1/tokenize", json={"prompt": SHARED_PREFIX}, timeout=10)
    prefix_tokens = tokenized.json()["count"]
    assert prefix_tokens >= 350
    before = [_counters(r) for r in cluster.replicas]
    cached_per_request = []
    for question in QUESTIONS:  # one after another: no load imbalance for the router to correct
        r = httpx.post(f"{cluster.router.base_url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": SHARED_PREFIX + question, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        cached_per_request.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = [_counters(r) for r in cluster.replicas]
    served = [a["num_requests_total"] - b["num_requests_total"] for a, b in zip(after, before, strict=True)]
    assert sorted(served) == [0, len(QUESTIONS)], f"requests per replica: {served}"
    hit = served.index(len(QUESTIONS))
    # Every request after the first reuses the shared prefix from the replica's radix cache
    # (a token or two at the prefix/question seam may tokenize differently).
    assert all(c >= prefix_tokens - 2 for c in cached_per_request[1:]), cached_per_request
    cached = after[hit]["cached_tokens_total"] - before[hit]["cached_tokens_total"]
    assert cached >= (len(QUESTIONS) - 1) * (prefix_tokens - 2), (cached, prefix_tokens)
    other = 1 - hit
    assert after[other] == before[other], "the other replica saw none of them"
