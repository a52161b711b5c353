"""Tensor-parallel rank processes for tests that build their own groups: each rank a
spawned interpreter, every one joined or killed before the test ends."""

from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp


def spawn_rank(target: Callable[..., None], *args: object) -> mp.Process:
    """`target(*args)` in a fresh interpreter (spawn: no state of this process's torch)."""
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def join_ranks(procs: list[mp.Process], timeout_s: float = 120) -> None:
    """Wait up to `timeout_s` for each; kill whatever is still alive."""
    try:
        for p in procs:
            p.join(timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
