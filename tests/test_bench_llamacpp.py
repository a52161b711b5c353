"""`bench/llamacpp.py` starts a llama-server with the flags its --help lists, waits for
/health and always stops it. CI has no llama.cpp: a fake `llama-server` (a stdlib
script) takes the same flags and streams /v1/completions like llama.cpp does. The
end-to-end `sluice bench serving --compare-llamacpp` test is in tests/test_bench.py,
next to the tiny server it runs against."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import llamacpp
from bench.llamacpp import LlamaServer, LlamaServerError, server_command

FAKE_LLAMA_SERVER = r'''
import argparse, json, os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser(description="fake llama-server")
p.add_argument("-m", "--model", required=True)
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, required=True)
p.add_argument("-c", "--ctx-size", type=int, default=0)
p.add_argument("-np", "--parallel", type=int, default=1)
p.add_argument("-t", "--threads", type=int, default=1)
p.add_argument("--no-webui", action="store_true")
args = p.parse_args()
if os.environ.get("FAKE_LLAMA_RECORD"):
    with open(os.environ["FAKE_LLAMA_RECORD"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:]}) + "\n")
if os.environ.get("FAKE_LLAMA_EXIT"):
    print("error: failed to load model", flush=True)
    sys.exit(3)
if os.environ.get("FAKE_LLAMA_IGNORE_SIGTERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"code": 404, "message": "File Not Found"}})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            return self._json(404, {"error": {"code": 404, "message": "File Not Found"}})
        prompt, n = req["prompt"], int(req.get("n_predict", req.get("max_tokens", 16)))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(n):
            chunk = {"choices": [{"text": f" t{i}", "index": 0, "finish_reason": None}], "object": "text_completion"}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
        final = {"choices": [{"text": "", "index": 0, "finish_reason": "length"}], "usage": usage}
        self.wfile.write(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
'''


def write_fake_llama_server(directory: Path) -> Path:
    """An executable `llama-server` stand-in (stdlib only) under `directory`."""
    path = directory / "llama-server"
    path.write_text(f"#!{sys.executable}\n{FAKE_LLAMA_SERVER}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def recorded_starts(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, Path]:
    """(fake binary, a GGUF path for it, the file where every start records its pid and argv)."""
    record = tmp_path / "starts.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(record))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return write_fake_llama_server(tmp_path), gguf, record


def test_command_uses_the_flag_names_help_lists() -> None:
    help_text = "-m,    --model FNAME\n--host HOST\n--port PORT\n-c,    --ctx-size N\n-np,   --parallel N\n-t,    --threads N\n--no-webui, --no-ui"
    cmd = server_command("bin", help_text, Path("m.gguf"), 8080, 4096, 4, 2)
    assert cmd == ["bin", "--model", "m.gguf", "--host", "127.0.0.1", "--port", "8080", "--ctx-size", "4096",
                   "--parallel", "4", "--threads", "2", "--no-webui"]
    old = help_text.replace("--no-webui, --no-ui", "").replace("--parallel", "")
    assert "--no-webui" not in server_command("bin", old, Path("m.gguf"), 1, 2, 3, 4)
    assert "-np" in server_command("bin", old, Path("m.gguf"), 1, 2, 3, 4)
    with pytest.raises(LlamaServerError, match="--port"):
        server_command("bin", help_text.replace("--port PORT", ""), Path("m.gguf"), 1, 2, 3, 4)


def test_server_is_healthy_inside_and_gone_after(fake: tuple[Path, Path, Path]) -> None:
    binary, gguf, record = fake
    with LlamaServer(binary, gguf, ctx=1024, parallel=3, threads=2) as server:
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        (start,) = recorded_starts(record)
        assert start["argv"] == server.cmd[1:]
        assert ["--parallel", "3"] == server.cmd[server.cmd.index("--parallel"):][:2] and "--no-webui" in server.cmd
    assert server.proc is not None and server.proc.returncode is not None
    assert not is_alive(int(start["pid"]))


def test_server_that_ignores_sigterm_is_killed(fake: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    binary, gguf, record = fake
    monkeypatch.setenv("FAKE_LLAMA_IGNORE_SIGTERM", "1")
    monkeypatch.setattr(llamacpp, "STOP_TIMEOUT", 0.5)
    with LlamaServer(binary, gguf, ctx=256, parallel=1) as server:
        pass
    assert server.proc is not None and server.proc.returncode == -signal.SIGKILL
    assert not is_alive(int(recorded_starts(record)[0]["pid"]))


def test_failed_start_reports_the_log_and_leaves_no_process(fake: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    binary, gguf, record = fake
    monkeypatch.setenv("FAKE_LLAMA_EXIT", "1")
    with pytest.raises(LlamaServerError, match="failed to load model"):
        LlamaServer(binary, gguf, ctx=256, parallel=1).start()
    assert not is_alive(int(recorded_starts(record)[0]["pid"]))
    with pytest.raises(LlamaServerError, match="GGUF not found"):
        LlamaServer(binary, gguf.with_name("missing.gguf"), ctx=256, parallel=1).start()


def test_default_gguf_is_the_one_sluice_serves() -> None:
    from runtime.model_executor.model_loader import DEFAULT_GGUF_NAME

    path = llamacpp.default_gguf()
    assert path.name == DEFAULT_GGUF_NAME and path.is_file()
