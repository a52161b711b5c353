"""The CPU kernel is built with -march=native: its cache key names the CPU's instruction set."""

from __future__ import annotations

from pathlib import Path

import pytest

import kernels.cpu as cpu


def test_a_cpu_with_other_flags_gets_its_own_kernel_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: b"flags : avx2 avx512f amx_tile")
    with_amx = cpu._build_dir()
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: b"flags : avx2")
    without_amx = cpu._build_dir()
    assert with_amx != without_amx and with_amx.parent == without_amx.parent == tmp_path / "sluice" / "kernels"


def test_this_cpus_flags_are_read() -> None:
    flags = cpu._cpu_flags()
    assert flags and (not Path("/proc/cpuinfo").exists() or flags.startswith(b"flags"))


def test_a_build_killed_midway_does_not_hang_the_next_start(tmp_path: Path) -> None:
    """torch's loader waits while its `lock` file exists; a build killed midway leaves one.
    A process holding the build guard and then killed must not block the next one either."""
    import subprocess
    import sys
    import threading

    (tmp_path / "lock").touch()  # left by a killed build
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(600)", str(tmp_path / "sluice.lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()  # a start interrupted while building (and never left behind)
        holder.wait()
    entered = threading.Event()

    def start() -> None:
        with cpu._exclusive_build(tmp_path):
            entered.set()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(timeout=120)  # a deadlock detector, not a speed bound
    assert entered.is_set(), "the build guard outlived its killed holder"
    assert not (tmp_path / "lock").exists()
