"""The CPU kernels' build cache: one per instruction set (-march=native), safe against a
killed build, shared by checkouts, and always built by the same ninja."""

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


def test_two_checkouts_of_the_same_sources_build_from_the_same_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """ninja rebuilds when a compile command changes, and the command names the sources'
    paths: two checkouts (a CI clone beside a working tree) must hand it the same ones,
    untouched, or each start rebuilds the other's kernels."""
    checkouts = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        for p in [*cpu._SOURCES, *cpu._HEADERS]:
            (d / p.name).write_bytes(p.read_bytes())
        checkouts.append(d)
    build_dir = tmp_path / "build"
    build_dir.mkdir()
    staged = []
    for d in checkouts:
        monkeypatch.setattr(cpu, "_SOURCES", sorted(d.glob("*.cpp")))
        monkeypatch.setattr(cpu, "_HEADERS", sorted(d.glob("*.h")))
        staged.append(cpu._stage_sources(build_dir))
        if len(staged) == 1:
            mtimes = {p: p.stat().st_mtime_ns for p in (build_dir / "src").iterdir()}
    assert staged[0] == staged[1] and all(p.parent == build_dir / "src" for p in staged[0])
    assert {p.name for p in staged[0]} == {p.name for p in cpu._SOURCES}
    assert {p: p.stat().st_mtime_ns for p in (build_dir / "src").iterdir()} == mtimes, "an unchanged source was rewritten"
    for p in (build_dir / "src").iterdir():
        assert p.read_bytes() == (checkouts[0] / p.name).read_bytes()


def test_the_kernels_load_with_sluices_own_ninja_whatever_is_first_on_path(tmp_path: Path) -> None:
    """`make serve` runs .venv/bin/sluice without the venv on PATH. The kernels must still
    load, built by the ninja package sluice installs: not by none (the torch paths, several
    times slower), nor by a system ninja, whose build log another ninja version reads as
    stale (every switch between the two rebuilt every kernel at a start)."""
    import os
    import subprocess
    import sys

    decoy = tmp_path / "bin"
    decoy.mkdir()
    (decoy / "ninja").write_text(f"#!/bin/sh\ntouch {tmp_path / 'decoy-ran'}\nexit 1\n")
    (decoy / "ninja").chmod(0o755)
    env = {**os.environ, "PATH": os.pathsep.join([str(decoy), "/usr/local/bin", "/usr/bin", "/bin"])}
    script = "import kernels.cpu as cpu; ops = cpu.load_cpu_ops(); print(ops is not None and hasattr(ops, 'f32_linear'))"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900
    )
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]
    assert not (tmp_path / "decoy-ran").exists(), "the ninja first on PATH ran, not sluice's"
