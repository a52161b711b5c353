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
