"""Compiled CPU kernels, built once per machine with torch's C++ extension loader.

One extension, `sluice_cpu_ops`, from every .cpp in this directory:

  paged_decode.cpp  decode attention read in place from the KV pool (the fast path)
  paged_attention.cpp  every token's attention in one per-query order, decode and
                    extend alike (deterministic inference)
  attention_span.h  that per-query arithmetic, shared with paged_decode.cpp
  fused_ops.cpp     RMSNorm (+ residual add), RoPE in place, SiLU·mul, the KV write:
                    a decoder layer's row-wise ops in one pass each
  q8_linear.cpp     float32 x int8-block matmul (the GGUF's Q8_0 LM head)
  q4_linear.cpp     Q4-block weights x int8-block activations on AVX512-VNNI or AVX2 (gguf linears)
  bf16_linear.cpp   bfloat16 x bfloat16 -> float32 on AMX or AVX512-BF16 (the dense copies' path)
  f32_linear.cpp    float32 GEMM on AVX2's FMA units (the dense copies' path without native bf16)
  decode_stack.cpp  a decode batch's decoder layers in one call, from the kernels above
  shm_comm.cpp      tensor-parallel collectives between the ranks of one machine, in
                    shared memory (runtime/distributed/shm_comm.py)
  cpu_common.h      the vector ISA at::vec compiles for; K/V row widening
  spin_pool.h       the kernels' threads: they spin between the calls of a step, where
                    OpenMP's, with two teams in the process, sleep and must be woken

Pure torch cannot read paged KV in place (decode attention had to gather every
request's KV), and a small model's decode step is mostly the dispatch of small
row-wise ops. Building needs a C++ compiler and ninja; where either is missing,
callers fall back to the torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, cast

import structlog
import torch

log = structlog.get_logger("sluice.kernels")
_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_loaded: dict[str, CpuOps | None] = {}


class ShmCommClass(Protocol):
    """kernels/cpu/shm_comm.cpp's class: the constructor and its one static method."""

    def __call__(
        self, segment: torch.Tensor, rank: int, world: int, slot_bytes: int, pids: list[int], start_times: list[int],
        spin_us: float,
    ) -> object: ...  # fmt: skip

    def segment_bytes(self, world: int, slot_bytes: int) -> int: ...


class CpuOps(Protocol):
    """The extension's functions (kernels/cpu/bindings.cpp)."""

    def paged_attention(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_idx: torch.Tensor,
        token_req: torch.Tensor, lens: torch.Tensor, scale: float,
    ) -> torch.Tensor: ...  # fmt: skip

    def paged_decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_idx: torch.Tensor, lens: torch.Tensor, scale: float
    ) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def rotary_(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, heads: int, head_dim: int) -> None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def store_kv(
        self, k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, round_src: bool = False
    ) -> None: ...

    def cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor: ...

    # `DecodeStack(per_layer, final_norm, cos_sin_cache, num_heads, num_kv_heads, head_dim, scale, eps,
    # dense_min_rows, comm=None, comm_timeout_s=0.0)` (comm: a ShmComm, under tensor parallelism):
    # a class (runtime/models/cpu_path.py FusedDecodeStack builds and calls it)
    DecodeStack: Callable[..., object]

    def q8_linear(self, x: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> torch.Tensor: ...

    def q4_linear_isa(self) -> str: ...

    def q4_linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor: ...

    def q8_linear_vnni(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor: ...

    def f32_linear_isa(self) -> str: ...

    def f32_linear(self, x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor: ...

    def bf16_linear_isas(self) -> list[str]: ...

    def bf16_linear(self, x: torch.Tensor, packed: torch.Tensor, isa: str = "") -> torch.Tensor: ...

    def bf16_linear_silu_mul(self, x: torch.Tensor, packed: torch.Tensor, isa: str = "") -> torch.Tensor: ...

    # a class: runtime/distributed/shm_comm.py builds it and calls its collectives
    ShmComm: ShmCommClass


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


# -mprefer-vector-width=512: GCC's -march=native on Intel server cores auto-vectorizes
# with 256-bit registers (a down-clocking hedge); these kernels' loops want all 16 lanes.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]


# In the cache key: a loader without _exclusive_build's guard (an older sluice) holds
# torch's `lock` while it builds, which this one would take for a leftover; the two never
# share a directory.
BUILD_GUARD = b"flock-guarded loader"


def _build_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice" / "kernels"
    sources = b"".join(p.name.encode() + p.read_bytes() for p in [*_SOURCES, *_HEADERS])
    key = sources + " ".join(CFLAGS).encode() + torch.__version__.encode() + _cpu_flags() + BUILD_GUARD
    digest = hashlib.sha256(key).hexdigest()[:16]
    path = base / f"cpu_ops-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _exclusive_build(build_dir: Path) -> Iterator[None]:
    """One process at a time builds or loads `build_dir`'s extension. torch's loader keeps
    builds apart with a `lock` file there and waits, forever, while one exists; a build
    killed midway (Ctrl-C on a first start) leaves it behind, and every later start would
    hang. Here an flock, which the kernel drops when its holder dies, guards the loader;
    whoever holds it is the only process inside, so a `lock` it finds is such a leftover."""
    with open(build_dir / "sluice.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (build_dir / "lock").exists():
            log.warning("removing the lock of an interrupted kernel build", path=str(build_dir / "lock"))
            (build_dir / "lock").unlink(missing_ok=True)
        yield


def _stage_sources(build_dir: Path) -> list[Path]:
    """The sources, copied into `build_dir/src`; the .cpp paths to build. ninja rebuilds
    when a compile command changes, and the command names each source's path: two
    checkouts of the same code (a CI clone beside a working tree) building from their
    own paths would rebuild each other's kernels on every start. From here every
    checkout with these contents (the directory's key) names the same paths."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for p in [*_SOURCES, *_HEADERS]:
        staged = src / p.name
        data = p.read_bytes()
        if not staged.is_file() or staged.read_bytes() != data:  # rewriting would touch its mtime
            staged.write_bytes(data)
    return [src / p.name for p in _SOURCES]


@contextmanager
def _our_ninja() -> Iterator[None]:
    """torch runs the first `ninja` on PATH. The one sluice depends on (the `ninja` package)
    sits in this environment's bin directory, on PATH only in an activated shell: `make
    serve` (.venv/bin/sluice) ran a system ninja or found none (no kernels), an activated
    shell the package's, and two ninja versions read each other's build log as stale, so
    every switch rebuilt every kernel (~90 s, at a server start). Here it is always the
    package's, where installed."""
    try:
        import ninja

        bin_dir = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):  # not installed, or a package without BIN_DIR
        yield
        return
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([bin_dir, path])
    try:
        yield
    finally:
        os.environ["PATH"] = path


def load_cpu_ops() -> CpuOps | None:
    """The compiled extension, built on first use (then cached per CPU), or None."""
    if "ops" not in _loaded:
        _loaded["ops"] = None
        try:
            from torch.utils.cpp_extension import is_ninja_available, load

            build_dir = _build_dir()
            with _our_ninja(), _exclusive_build(build_dir):
                if not is_ninja_available():
                    raise RuntimeError("ninja is not installed")
                if not any(build_dir.glob("*.so")):
                    log.info("building the CPU kernels (once per machine and CPU)...")
                module = load(
                    name="sluice_cpu_ops",
                    sources=[str(p) for p in _stage_sources(build_dir)],
                    build_directory=str(build_dir),
                    extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            _loaded["ops"] = cast(CpuOps, module)
        except Exception as exc:  # no compiler, no ninja, build error: use torch
            log.warning("CPU kernels unavailable; using the torch paths", error=str(exc))
    return _loaded["ops"]


def load_paged_decode() -> Callable[..., torch.Tensor] | None:
    """`paged_decode(q, k_buf, v_buf, kv_idx, lens, scale) -> out`, or None."""
    ops = load_cpu_ops()
    return None if ops is None else ops.paged_decode


class PinnedIsa:
    """`ops` with bf16_linear pinned to one of its `bf16_linear_isas()`, or to "none" (no
    tiles: the engine keeps oneDNN's bf16 copy); every other kernel as it is. For measuring
    and testing one ISA's path on a CPU that offers several (an AMX CPU has both)."""

    def __init__(self, ops: CpuOps, isa: str) -> None:
        if isa != "none" and isa not in ops.bf16_linear_isas():
            raise ValueError(f"bf16_linear isa {isa!r}: this CPU offers {ops.bf16_linear_isas()}")
        self.ops, self.isa = ops, isa

    def __getattr__(self, name: str) -> object:
        return getattr(self.ops, name)

    def bf16_linear_isas(self) -> list[str]:
        return [] if self.isa == "none" else [self.isa]

    def bf16_linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return self.ops.bf16_linear(x, packed, self.isa)

    def bf16_linear_silu_mul(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        return self.ops.bf16_linear_silu_mul(x, packed, self.isa)
