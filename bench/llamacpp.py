"""A `llama-server` subprocess for `sluice bench serving --compare-llamacpp BIN`.

`LlamaServer` starts llama.cpp's server from a given binary on a GGUF (default: the
embedded SmolLM2 GGUF sluice itself serves), waits for GET /health to answer 200 (a
bounded poll), and stops it on exit (SIGTERM, then SIGKILL). Flag names are read from
`BIN --help` at run time, so a renamed flag fails loudly instead of being ignored.
Nothing here runs in CI against a real llama.cpp; the tests drive a fake binary.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

STARTUP_TIMEOUT = 300.0
STOP_TIMEOUT = 10.0


class LlamaServerError(RuntimeError):
    pass


def default_gguf() -> Path:
    """The GGUF sluice serves by default (located without importing its package)."""
    from runtime.model_executor.model_loader import default_model_path

    return default_model_path()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pick(help_text: str, *names: str) -> str:
    """The first of `names` that `--help` lists as a flag (long names first)."""
    words = set(help_text.replace(",", " ").split())
    for name in names:
        if name in words:
            return name
    raise LlamaServerError(f"llama-server --help lists none of {names}: is this llama.cpp's server?")


def server_command(binary: str, help_text: str, gguf: Path, port: int, ctx: int, parallel: int, threads: int) -> list[str]:
    cmd = [
        binary,
        _pick(help_text, "--model", "-m"), str(gguf),
        _pick(help_text, "--host"), "127.0.0.1",
        _pick(help_text, "--port"), str(port),
        _pick(help_text, "--ctx-size", "-c"), str(ctx),
        _pick(help_text, "--parallel", "-np"), str(parallel),
        _pick(help_text, "--threads", "-t"), str(threads),
    ]
    words = set(help_text.replace(",", " ").split())
    cmd += [flag for flag in ("--no-webui",) if flag in words]
    return cmd


class LlamaServer:
    """`with LlamaServer(bin, gguf, ctx=..., parallel=...) as s:` -> s.base_url is healthy."""

    def __init__(
        self,
        binary: str | os.PathLike[str],
        gguf: Path | None = None,
        *,
        ctx: int,
        parallel: int,
        threads: int | None = None,
        startup_timeout: float = STARTUP_TIMEOUT,
    ) -> None:
        self.binary = str(Path(binary).expanduser())
        self.gguf = gguf if gguf is not None else default_gguf()
        self.ctx = ctx
        self.parallel = parallel
        self.threads = threads or os.cpu_count() or 1
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.cmd: list[str] = []

    def _help(self) -> str:
        try:
            out = subprocess.run([self.binary, "--help"], capture_output=True, text=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            raise LlamaServerError(f"cannot run {self.binary} --help: {exc}") from exc
        return out.stdout + out.stderr

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> Self:
        if not self.gguf.is_file():
            raise LlamaServerError(f"GGUF not found: {self.gguf}")
        self.cmd = server_command(self.binary, self._help(), self.gguf, self.port, self.ctx, self.parallel, self.threads)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LlamaServerError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while the model loads
            time.sleep(0.2)
        raise LlamaServerError(f"llama-server not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
