"""SIGTERM drains: in-flight requests finish, new ones and /health get 503, exit code 0."""

from __future__ import annotations

import signal
import threading
from typing import Any

import httpx
from server_helpers import (
    ServerProcess,
    assert_error_envelope,
    poll_until,
    sse_payloads,
)


def test_sigterm_finishes_in_flight_streams_then_exits_0() -> None:
    server = ServerProcess().start().wait_ready()
    try:
        results: dict[int, Any] = {}

        def stream(i: int) -> None:
            body = {"prompt": f"Story number {i}:", "max_tokens": 64, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                with server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
                    results[i] = sse_payloads(r)
            except Exception as exc:  # noqa: BLE001 - reported by the asserts below
                results[i] = exc

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        poll_until(lambda: server.server_info()["num_running_reqs"] == 2, timeout=60, what="both requests running")
        server.signal(signal.SIGTERM)

        def health_refused_or_503() -> bool:
            try:
                return httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503
            except httpx.TransportError:
                return True

        poll_until(health_refused_or_503, timeout=30, what="/health to stop answering 200")
        try:
            r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
        except httpx.TransportError:
            pass  # already closed: also a refusal
        else:
            assert assert_error_envelope(r, 503)["code"] == "server_shutting_down"

        for t in threads:
            t.join(timeout=120)
        for i in range(2):
            payloads = results[i]
            assert isinstance(payloads, list), payloads
            assert payloads[-1]["usage"]["completion_tokens"] == 64
            finishes = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
            assert finishes == ["length"]
        assert server.wait_exit(timeout=60) == 0, server.log_tail()
    finally:
        server.stop()


def test_a_model_that_fails_to_load_exits_1() -> None:
    server = ServerProcess("--model-path", "/nonexistent/model").start()
    try:
        assert server.wait_exit(timeout=120) == 1, server.log_tail()
        assert "engine failed to start" in server.log_path.read_text(errors="replace")
    finally:
        server.stop()
