"""The tensor-parallel group's two timeouts: ranks may take longer than `dist_timeout`
to meet (a rank still importing torch, a node started by hand), while a collective
with a missing rank fails after `dist_timeout` instead of waiting forever."""

from __future__ import annotations

import datetime
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from runtime.distributed.parallel_state import (
    destroy_tensor_parallel,
    init_tensor_parallel,
    tensor_model_parallel_all_reduce,
)
from tests.rank_helpers import join_ranks, spawn_rank
from tests.server_helpers import free_port

TIMEOUT_S = 1.0  # a collective's bound
LATE_S = 4 * TIMEOUT_S  # how late rank 1 joins


def _rank_main(rank: int, init_method: str, workdir: str) -> None:
    out = Path(workdir) / f"rank{rank}.txt"
    try:
        if rank == 1:
            time.sleep(LATE_S)
        init_tensor_parallel(rank, 2, init_method, torch.device("cpu"), timeout_s=TIMEOUT_S)
        total = tensor_model_parallel_all_reduce(torch.tensor([float(rank + 1)]))
        lines = [f"sum {total.item():g}"]
        if rank == 0:
            # rank 1 is alive but never joins this one: it must time out, not hang
            try:
                tensor_model_parallel_all_reduce(torch.ones(1))
                lines.append("second all-reduce returned")
            except RuntimeError as exc:
                lines.append("second all-reduce " + ("timed out" if "timed out" in str(exc).lower() else repr(exc)))
        else:
            while not (Path(workdir) / "rank0.txt").exists():
                time.sleep(0.05)
        out.write_text("\n".join(lines))
        destroy_tensor_parallel(abandon=True)
    except BaseException:
        out.write_text(traceback.format_exc())
        raise


def test_a_late_rank_joins_and_a_missing_rank_fails_the_collective(tmp_path: Path) -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn_rank(_rank_main, r, init_method, str(tmp_path)) for r in range(2)]
    join_ranks(procs)
    results = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert results[1] == "sum 3", results[1]
    assert results[0] == "sum 3\nsecond all-reduce timed out", results[0]
    assert [p.exitcode for p in procs] == [0, 0]


def _rank1_leaves_after_the_store(port: int) -> None:
    """Rank 1 reaches the rendezvous, then dies before the group is built."""
    dist.TCPStore("127.0.0.1", port, world_size=2, is_master=False, timeout=datetime.timedelta(seconds=60))


def _rank1_all_reduces(init_method: str) -> None:
    init_tensor_parallel(1, 2, init_method, torch.device("cpu"), timeout_s=30)
    tensor_model_parallel_all_reduce(torch.ones(1))
    destroy_tensor_parallel()


def test_a_group_that_failed_to_build_does_not_break_the_next_one_in_the_process() -> None:
    """An offline `Engine(tp_size=2)` whose rank died while starting is followed by one that
    works, in the same process (rank 0 is this test's process)."""
    port = free_port()
    dead = spawn_rank(_rank1_leaves_after_the_store, port)
    try:
        with pytest.raises(RuntimeError):
            init_tensor_parallel(0, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=TIMEOUT_S)
    finally:
        join_ranks([dead])

    init_method = f"tcp://127.0.0.1:{free_port()}"
    live = spawn_rank(_rank1_all_reduces, init_method)
    try:
        init_tensor_parallel(0, 2, init_method, torch.device("cpu"), timeout_s=30)
        assert tensor_model_parallel_all_reduce(torch.ones(1)).item() == 2.0
    finally:
        destroy_tensor_parallel()
        join_ranks([live])
    assert live.exitcode == 0
