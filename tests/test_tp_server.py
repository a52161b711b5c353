"""Tensor parallelism as operators run it: real `sluice serve` processes on loopback.

- Two "nodes" (`--nnodes 2 --node-rank 0/1 --dist-init-addr`) serve HF's outputs, and
  the worker node exits cleanly when node 0 shuts down.
- Killing a worker rank: /health turns 503, the in-flight request ends with an
  error instead of hanging, and the server exits non-zero.
- A tp_size the model's heads do not allow is refused at start-up, clearly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import HFOracle, assert_greedy_equal
from tests.server_helpers import REPO, ServerProcess, free_port, poll_until
from tests.tiny_checkpoints import make_llama_checkpoint

MAX_NEW = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("llama-tp-server"), tokenizer, num_kv_heads=2)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(p) for p in out.split()]


def _worker_ranks(pid: int) -> list[int]:
    """The tensor-parallel ranks `pid` started: the children of its multiprocessing
    forkserver (runtime/distributed/launcher.py rank_context), or its spawned children
    where there is no forkserver; not multiprocessing's resource tracker."""
    ranks = []
    for child in _children(pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"resource_tracker" in cmdline:
            continue
        if b"forkserver" in cmdline:
            ranks += _children(child)
        elif b"spawn_main" in cmdline:
            ranks.append(child)
    return ranks


def _health_is_503(server: ServerProcess) -> bool:
    try:
        return httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 503
    except httpx.HTTPError:
        return False


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.stop()


def _generate(server: ServerProcess, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}}
    with server.client() as client:
        r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out: list[int] = r.json()["output_ids"]
    return out


def test_two_nodes_on_loopback_serve_hf_outputs(checkpoint: Path, prompts: list[list[int]], servers: list[ServerProcess]) -> None:
    addr = f"127.0.0.1:{free_port()}"
    dist = ["--model-path", str(checkpoint), "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--dtype", "float32", *dist, "--node-rank", "1"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        node0 = ServerProcess(*dist, "--node-rank", "0").start()
        servers.append(node0)
        node0.wait_ready()
        oracle = HFOracle(checkpoint)
        for prompt in prompts[:3]:
            assert_greedy_equal(oracle, prompt, _generate(node0, prompt), MAX_NEW)
        node0.signal(signal.SIGTERM)
        assert node0.wait_exit(60) == 0, node0.log_tail()
        assert node1.wait(timeout=60) == 0, "the worker node did not exit cleanly after node 0 shut down"
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(timeout=30)


def test_killing_a_worker_rank_fails_requests_and_exits_non_zero(checkpoint: Path, servers: list[ServerProcess]) -> None:
    server = ServerProcess("--model-path", str(checkpoint), "--tp-size", "2", "--dist-timeout", "20").start()
    servers.append(server)
    server.wait_ready()
    assert server.proc is not None
    # Both processes froze their start-up heap, so a full GC collection mid-serving does not walk it.
    frozen = re.findall(r"startup heap frozen .*objects=(\d+) where=(\S+)", server.log_path.read_text(errors="replace"))
    assert sorted(where for _, where in frozen) == ["server", "tp-rank-1"] and all(int(n) > 10_000 for n, _ in frozen), frozen
    (worker,) = _worker_ranks(server.proc.pid)

    body = {"input_ids": [1, 2, 3, 4], "stream": True, "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}}
    events: list[dict[str, Any]] = []
    with httpx.Client(base_url=server.base_url, timeout=60.0) as client, client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(orjson.loads(line[len("data: "):]))
            if len(events) == 1:
                os.kill(worker, signal.SIGKILL)
    final = events[-1]
    reason = final.get("meta_info", {}).get("finish_reason") or final.get("error")
    assert reason is not None and (isinstance(reason, dict) and reason.get("type") == "abort" or "error" in final), final
    assert len(final.get("output_ids", [])) < 1000

    poll_until(lambda: _health_is_503(server), timeout=20, what="/health to turn 503 after a rank died")
    assert server.wait_exit(60) != 0, server.log_tail()
    assert "tensor-parallel" in server.log_tail(200)


def test_tp_size_the_heads_do_not_allow_is_refused_at_startup(servers: list[ServerProcess]) -> None:
    server = ServerProcess("--tp-size", "2").start()  # SmolLM2: 9 attention heads
    servers.append(server)
    assert server.wait_exit(120) != 0
    assert "tp_size=2 must divide the model's num_attention_heads=9" in server.log_tail(200)


def test_a_hung_worker_rank_is_found_by_the_heartbeat_while_idle(checkpoint: Path, servers: list[ServerProcess]) -> None:
    """A rank that stops answering (SIGSTOP) with no traffic at all: the idle heartbeat's
    all-reduce times out after --dist-timeout, and the server turns 503 and exits non-zero."""
    # A short --dist-timeout: it bounds collectives only, not the ranks' rendezvous (on a
    # Zen 1 EPYC a rank process takes over 4 s to start and join).
    server = ServerProcess("--model-path", str(checkpoint), "--tp-size", "2", "--dist-timeout", "4").start()
    servers.append(server)
    server.wait_ready()
    assert server.proc is not None
    (worker,) = _worker_ranks(server.proc.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        # heartbeat every dist_timeout / 4 = 1 s, then up to 4 s for its all-reduce to time out
        poll_until(lambda: _health_is_503(server), timeout=30, what="/health to turn 503 after a rank hung")
        assert server.wait_exit(60) != 0, server.log_tail()
    finally:
        with contextlib.suppress(ProcessLookupError):  # the server kills a failed rank itself
            os.kill(worker, signal.SIGKILL)
