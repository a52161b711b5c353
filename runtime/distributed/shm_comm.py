"""Collectives in shared memory for the tensor-parallel ranks of one machine.

gloo, the CPU backend, moves every collective through loopback sockets and a chain of
thread hand-offs: ~2 ms an all-reduce of one decode row on a 2-core VM, ~0.26 ms on
another (bench/RESULTS.md items 8 and 35), and a decode step runs two per layer. SGLang's
CPU backend and vLLM's CPU communicator keep the ranks of one machine in shared memory
instead; so does this: one segment in /dev/shm that every rank maps, its collectives in
kernels/cpu/shm_comm.cpp (a copy, an atomic store, a wait, a read: microseconds while
the ranks are on cores).

gloo stays the group's backend: the rendezvous, the load-time collectives, and every
collective when the segment cannot serve the whole group. `open_shm_group` returns a
group only where every rank has the CPU kernels, maps the same segment, and sees every
other rank's process in /proc (a dead peer is told by its pid and start time); the ranks
decide together, so all of them use it or none does.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

import structlog
import torch
import torch.distributed as dist

log = structlog.get_logger("sluice.tp")

SHM_DIR = Path("/dev/shm")
# Per rank and op parity. A decode step's all-reduce is rows x hidden floats (16 x 576 x 4
# = 36 KB for SmolLM2); larger tensors (a prefill's, the logits' all-gather) go through in
# slot-sized ops.
SLOT_BYTES = 1 << 20
# How long a rank spins on the others' arrival before it sleeps on the segment's futex: a
# layer's next collective is tens of microseconds to milliseconds away; past this the core
# is worth more to another thread (the scheduler's, or a rank sharing it).
SPIN_US = 200.0
STORE_KEY = "sluice/shm_segment"
REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16)  # summed in float32, in rank order


class ShmCommOps(Protocol):
    """kernels/cpu/shm_comm.cpp's ShmComm."""

    def all_reduce_(self, x: torch.Tensor, timeout_s: float) -> None: ...

    def all_gather(self, x: torch.Tensor, timeout_s: float) -> torch.Tensor: ...

    def broadcast_(self, x: torch.Tensor, root: int, timeout_s: float) -> None: ...


@dataclass(frozen=True, slots=True)
class ShmGroup:
    comm: ShmCommOps
    timeout_s: float  # each collective's bound, as the gloo group's

    def serves(self, x: torch.Tensor, reduce: bool = False) -> bool:
        """Whether `x` can take these collectives (else gloo's): contiguous CPU tensors,
        floating point to be summed."""
        return x.device.type == "cpu" and x.is_contiguous() and (not reduce or x.dtype in REDUCIBLE)

    def all_reduce_(self, x: torch.Tensor) -> None:
        self.comm.all_reduce_(x, self.timeout_s)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: rank r's x at [r]."""
        return self.comm.all_gather(x.contiguous(), self.timeout_s)

    def broadcast_(self, x: torch.Tensor, root: int, forever: bool = False) -> None:
        """`forever`: no timeout (a dead peer still fails it)."""
        self.comm.broadcast_(x, root, 0.0 if forever else self.timeout_s)


def start_time(pid: int) -> int:
    """The process's start (clock ticks since boot, /proc/PID/stat field 22), or -1."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def open_shm_group(store: dist.Store, rank: int, size: int, timeout_s: float) -> ShmGroup | None:
    """The group's shared-memory collectives, or None (every rank gets the same answer).
    Collective over the gloo group that init_process_group just built."""
    from kernels.cpu import load_cpu_ops

    ops = load_cpu_ops()
    nbytes = 0 if ops is None else ops.ShmComm.segment_bytes(size, SLOT_BYTES)
    if rank == 0:
        path = _create_segment(nbytes) if ops is not None else ""
        store.set(STORE_KEY, path)
    else:
        path = store.get(STORE_KEY).decode()
    segment = None
    if ops is not None and path:
        with contextlib.suppress(RuntimeError, OSError):
            segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    me = torch.tensor([int(segment is not None), os.getpid(), start_time(os.getpid())], dtype=torch.int64)
    everyone = [torch.empty_like(me) for _ in range(size)]
    dist.all_gather(everyone, me)
    peers = [(int(p), int(t)) for _, p, t in (e.tolist() for e in everyone)]
    # Every rank's process in this /proc (the same pid namespace): how a wait tells a dead peer.
    visible = all(started >= 0 and start_time(pid) == started for pid, started in peers)
    agree = torch.tensor([int(segment is not None and visible)], dtype=torch.int64)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)  # every rank has mapped it or given up
    if rank == 0 and path:
        os.unlink(path)  # the mappings stay; nothing is left in /dev/shm if a rank dies
    if not int(agree) or segment is None or ops is None:
        log.info("tensor-parallel collectives over gloo", reason="a rank lacks the CPU kernels, /dev/shm or the others' /proc")
        return None
    comm = ops.ShmComm(segment, rank, size, SLOT_BYTES, [p for p, _ in peers], [t for _, t in peers], SPIN_US)
    if rank == 0:
        log.info("tensor-parallel collectives in shared memory", ranks=size, segment_mib=round(nbytes / 2**20, 1))
    return ShmGroup(cast(ShmCommOps, comm), timeout_s)


def _create_segment(nbytes: int) -> str:
    """A zero-filled file of `nbytes` in /dev/shm (its path), or "" where there is none."""
    path = SHM_DIR / f"sluice-tp-{os.getpid()}-{secrets.token_hex(6)}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return ""
    try:
        os.ftruncate(fd, nbytes)
    except OSError:
        os.unlink(path)
        return ""
    finally:
        os.close(fd)
    return str(path)
