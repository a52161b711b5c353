"""KVPrefaulter: maps a CPU KV pool's pages a little ahead of the slots in use, on idle CPU.

A CPU pool is an anonymous mapping that the OS backs on first touch (kv_pool.py). On a KVM
guest a fresh 2 MB page cost 3-6 ms to map, and a fresh server's first 16-row batch of
16 x 128 -> 128 tokens took 4.04-4.14 s against 3.62-3.72 s with its first 16 384 slots
mapped beforehand (bench/RESULTS.md item 41): the worker thread was taking those faults
in the middle of its steps. Here a daemon thread takes them instead, ahead of the highest
slot a forward has written, only while no forward has run for `_QUIET_S` (a server starting
up, the gaps between bursts of requests), at SCHED_IDLE: mapping a page during a busy batch
only moved the fault onto a core the kernels were using (the first batch 4.0-4.1 s).

MADV_POPULATE_WRITE (Linux 5.14) maps pages without changing their contents, so racing
the worker's writes to the same pages is harmless. Where the kernel lacks it (EINVAL) or
the platform is not Linux, the prefaulter stops and the worker faults as before.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import weakref
import time
from collections.abc import Callable
from typing import Protocol, cast

import structlog

log = structlog.get_logger(__name__)

MADV_POPULATE_WRITE = 23
_AHEAD_BYTES = 128 << 20  # across all of a pool's buffers: ~2 MB a buffer for SmolLM2's 60
_CHUNK_BYTES = 2 << 20  # one madvise per buffer and chunk: a huge page's worth of slots
_RECHECK_S = 1.0  # how often an idle thread checks whether its pool still exists
_QUIET_S = 0.05  # no forward for this long: the worker is idle, the cores are free


class PrefaultedPool(Protocol):
    """What the thread needs of a pool: its buffers' start addresses and row bytes."""

    size: int

    def buffer_spans(self) -> list[tuple[int, int]]: ...  # (data_ptr, bytes per slot)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise  # a foreign call: releases the GIL
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], fn)


class KVPrefaulter:
    """Keeps slots [0, min(size, highest written + ahead)) of every buffer mapped.

    Invariant: `mapped` only grows, and every buffer's bytes of slots [0, mapped) have been
    populated (or the prefaulter has stopped for good: `stopped`)."""

    def __init__(self, pool: PrefaultedPool) -> None:
        spans = pool.buffer_spans()
        row_bytes = spans[0][1]  # every buffer's: [slots, kv_heads, head_dim] of one dtype
        self.size = pool.size
        self.ahead = max(_CHUNK_BYTES // row_bytes, _AHEAD_BYTES // (len(spans) * row_bytes))
        self.chunk = max(1, _CHUNK_BYTES // row_bytes)
        self.mapped = 0
        self.target = min(self.size, self.ahead)  # a start-up's idle core maps the first stretch
        self.stopped = False
        self._last_forward = 0.0
        self._wake = threading.Event()
        self._wake.set()
        self._madvise = _libc_madvise()
        if self._madvise is None:
            self.stopped = True
            return
        ref = weakref.ref(pool)  # the thread must not keep the pool's memory alive
        threading.Thread(target=self._run, args=(ref,), name="sluice-kv-prefault", daemon=True).start()

    def note_written(self, highest_slot: int) -> None:
        """Called per forward with the highest slot it writes (cheap: no syscall)."""
        self._last_forward = time.monotonic()
        target = min(self.size, highest_slot + 1 + self.ahead)
        if target > self.target:
            self.target = target
            self._wake.set()

    def wait_idle(self, timeout: float) -> bool:
        """Until everything up to the target is mapped (tests); False on timeout."""
        deadline = time.monotonic() + timeout
        while not (self.stopped or self.mapped >= self.target):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def _run(self, ref: weakref.ReferenceType[PrefaultedPool]) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except (AttributeError, OSError):
            pass
        while True:
            if not self._wake.wait(_RECHECK_S):
                if ref() is None:
                    return
                continue
            self._wake.clear()
            while self.mapped < self.target:
                quiet = time.monotonic() - self._last_forward
                if quiet < _QUIET_S:  # the worker is busy: its own faults until it pauses
                    time.sleep(_QUIET_S - quiet)
                    continue
                pool = ref()
                if pool is None:
                    return
                end = min(self.target, self.mapped + self.chunk)
                if not self._populate(pool.buffer_spans(), self.mapped, end):
                    self.stopped = True
                    return
                del pool  # no strong reference while idle
                self.mapped = end

    def _populate(self, spans: list[tuple[int, int]], begin: int, end: int) -> bool:
        assert self._madvise is not None
        for ptr, row in spans:
            lo = (ptr + begin * row) & ~4095
            hi = ptr + end * row
            if self._madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                log.info("KV prefault off", reason=os.strerror(err))  # e.g. EINVAL before Linux 5.14
                return False
        return True
