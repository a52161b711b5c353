"""Compiled CPU kernels, built once per machine with torch's C++ extension loader.

Pure torch cannot read paged KV in place: decode attention had to gather every
request's KV (a read, a write and a re-read of all of it). The C++ kernel reads
each K/V row once. Building needs a C++ compiler and ninja; where either is
missing, callers fall back to the torch path.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("sluice.kernels")
_SOURCE = Path(__file__).with_name("paged_decode.cpp")
_loaded: dict[str, Callable[..., torch.Tensor] | None] = {}


def _cpu_flags() -> bytes:
    """The CPU's instruction-set flags: the kernel is built with -march=native, so a
    build from another CPU (a shared home, a copied cache) must not be reused."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    import platform

    return f"{platform.machine()} {platform.processor()}".encode()


def _build_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice" / "kernels"
    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + _cpu_flags()).hexdigest()[:16]
    path = base / f"paged_decode-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_paged_decode() -> Callable[..., torch.Tensor] | None:
    """`paged_decode(q, k_buf, v_buf, kv_idx, lens, scale) -> out`, or None."""
    if "paged_decode" not in _loaded:
        _loaded["paged_decode"] = None
        try:
            from torch.utils.cpp_extension import is_ninja_available, load

            if not is_ninja_available():
                raise RuntimeError("ninja is not installed")
            build_dir = _build_dir()
            if not any(build_dir.glob("*.so")):
                log.info("building the CPU paged-decode kernel (once per machine and CPU)...")
            module = load(
                name="sluice_paged_decode",
                sources=[str(_SOURCE)],
                build_directory=str(build_dir),
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            _loaded["paged_decode"] = module.paged_decode
        except Exception as exc:  # no compiler, no ninja, build error: use torch
            log.warning("CPU paged-decode kernel unavailable; using torch gather + SDPA", error=str(exc))
    return _loaded["paged_decode"]
