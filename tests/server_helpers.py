"""Helpers for the server suites: real `sluice serve` subprocesses, SSE parsing, polling.
(The in-process app over a scripted fake engine: tests/fake_engine.py.)

Servers are process-wide singletons keyed by their flags (`shared_server`), started on
first use and stopped at interpreter exit, so several test modules share one server
without a conftest plugin. Every wait is a bounded poll; nothing sleeps to synchronise.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson


REPO = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct"
BASE_FLAGS = ("--dtype", "float32", "--quantization", "none", "--max-total-tokens", "4096")  # HF float32 numerics
STARTUP_TIMEOUT = 180.0  # the first start may convert the default GGUF

T = TypeVar("T")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll_until(check: Callable[[], T | None], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> T:
    """Call `check` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}; last={last!r}")


class ServerProcess:
    """One `python -m app.cli serve` subprocess on a free loopback port."""

    def __init__(self, *flags: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.api_key = api_key
        self.base_url = f"http://127.0.0.1:{self.port}"
        args = [*BASE_FLAGS, *flags] + (["--api-key", api_key] if api_key else [])
        self.cmd = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path = Path(tempfile.mkstemp(prefix="sluice-server-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self) -> ServerProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> ServerProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_tail()}")

    def signal(self, signum: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill()
        self.proc.wait(timeout=30)

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=timeout)

    def server_info(self) -> dict[str, Any]:
        r = httpx.get(f"{self.base_url}/get_server_info", headers=self.headers, timeout=10.0)
        r.raise_for_status()
        return dict(r.json())

    def wait_all_kv_free(self, timeout: float = 60.0) -> dict[str, Any]:
        """Poll until nothing runs or waits, flush the prefix cache, return server info.
        The caller asserts available_kv_tokens == max_total_num_tokens."""

        def idle_and_flushed() -> dict[str, Any] | None:
            info = self.server_info()
            if info["num_running_reqs"] or info["num_waiting_reqs"]:
                return None
            flushed = httpx.post(f"{self.base_url}/flush_cache", headers=self.headers, timeout=10.0)
            return self.server_info() if flushed.status_code == 200 else None

        return poll_until(idle_and_flushed, timeout=timeout, what="requests to end and the cache to flush")


ROUTER_STARTUP_TIMEOUT = 60.0


class RouterProcess:
    """`python -m sglang_router.launch_router ARGS...` (the real Rust router from PyPI
    sglang-router) on a free loopback port."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
            *args, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        ]
        self.log_path = Path(tempfile.mkstemp(prefix="sglang-router-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RouterProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log_path.read_text(errors="replace"))  # no ANSI colours

    def workers(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.base_url}/workers", timeout=5.0).json()["workers"])

    def wait_workers_healthy(self, count: int) -> list[dict[str, Any]]:
        def healthy() -> list[dict[str, Any]] | None:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                workers = self.workers()
            except httpx.HTTPError:
                return None
            return workers if len(workers) == count and all(w["is_healthy"] for w in workers) else None

        return poll_until(healthy, timeout=ROUTER_STARTUP_TIMEOUT, interval=0.1, what="the router's workers")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


_servers: dict[tuple[tuple[str, ...], str | None], ServerProcess] = {}


def shared_server(*flags: str, api_key: str | None = None) -> ServerProcess:
    """The process-wide server started with `flags` (started on first use)."""
    key = (flags, api_key)
    server = _servers.get(key)
    if server is None or server.proc is None or server.proc.poll() is not None:
        server = ServerProcess(*flags, api_key=api_key).start()
        _servers[key] = server
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
    return server


# The server with tight limits that several suites share (one process for all of them).
LIMITED_API_KEY = "sk-test-sluice"
LIMITED_BODY_BYTES = 2048


def limited_server() -> ServerProcess:
    """One running request, one queued, a 2 KiB body limit, and an API key."""
    return shared_server(
        "--max-running-requests", "1", "--max-queued-requests", "1",
        "--max-request-body-bytes", str(LIMITED_BODY_BYTES), api_key=LIMITED_API_KEY,
    )


# The server the trace and dashboard suites share (tests/test_server_trace.py, test_dashboard_browser.py).
TRACED_API_KEY = "sk-test-traces"


def start_traced_server() -> ServerProcess:
    """An API key, and a small trace buffer."""
    return shared_server("--trace-buffer-size", "64", api_key=TRACED_API_KEY)


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        server.stop()


def iter_sse(response: httpx.Response) -> Iterator[bytes]:
    """The raw events of an SSE body, each checked to be exactly `data: ...\\n\\n`."""
    buffer = b""
    pieces = [response.content] if response.is_stream_consumed else response.iter_raw()
    for piece in pieces:
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            assert event.startswith(b"data: "), f"bad SSE event {event!r}"
            assert b"\n" not in event, f"multi-line SSE event {event!r}"
            yield event[len(b"data: "):]
    assert buffer == b"", f"trailing bytes after the last event: {buffer!r}"


def sse_payloads(response: httpx.Response) -> list[dict[str, Any]]:
    """Every JSON event of a stream; asserts it ends with exactly one [DONE]."""
    events = list(iter_sse(response))
    assert events and events[-1] == b"[DONE]", f"stream did not end with [DONE]: {events[-3:]!r}"
    assert b"[DONE]" not in events[:-1]
    return [orjson.loads(e) for e in events[:-1]]


def assert_error_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)
