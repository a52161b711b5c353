"""The tensor-parallel collectives in shared memory (runtime/distributed/shm_comm.py):
the results gloo gives, the same bits on every rank, tensors past one slot, and a dead
or hung peer failing the collective instead of hanging it. Real processes, one per rank."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kernels.cpu import load_cpu_ops
from runtime.distributed import parallel_state
from runtime.distributed.parallel_state import (
    broadcast_from_rank0,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from runtime.distributed.shm_comm import SHM_DIR, SLOT_BYTES
from tests.rank_helpers import join_ranks, spawn_rank
from tests.server_helpers import free_port

pytestmark = pytest.mark.skipif(load_cpu_ops() is None, reason="the shared-memory collectives are a CPU kernel")

# Past one slot in every dtype: float32 in 3 ops (2 slots and a bit).
BIG = SLOT_BYTES // 2 + 1000


def _data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, generator=g).to(dtype)


def _collectives(rank: int, size: int, init_method: str, workdir: str) -> None:
    """Each rank saves what sluice's collectives gave and what gloo gave on the same data."""
    try:
        torch.set_num_threads(1)
        init_tensor_parallel(rank, size, init_method, torch.device("cpu"), timeout_s=60)
        assert parallel_state._SHM is not None, "the ranks of one machine use shared memory"
        out: dict[str, torch.Tensor] = {}
        for dtype in (torch.float32, torch.bfloat16):
            for n in (1, 640, BIG):
                x = _data(rank, n, dtype)
                ref = x.clone()
                dist.all_reduce(ref)
                out[f"reduce {dtype} {n}"] = tensor_model_parallel_all_reduce(x.clone())
                out[f"reduce gloo {dtype} {n}"] = ref
        rows = _data(rank, 3 * 700, torch.float32).reshape(3, 700)
        out["gather"] = tensor_model_parallel_all_gather(rows, dim=-1)
        big_rows = _data(rank, BIG, torch.float32).reshape(1, BIG)
        out["gather big"] = tensor_model_parallel_all_gather(big_rows, dim=0)
        for n in (6, BIG // 2 * 2):
            mine = torch.arange(n, dtype=torch.int64) * (rank + 1)
            out[f"broadcast {n}"] = broadcast_from_rank0(mine)
        torch.save(out, Path(workdir) / f"rank{rank}.pt")
        destroy_tensor_parallel()
    except BaseException:
        (Path(workdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _errors(workdir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(workdir.glob("*.err")))


@pytest.mark.parametrize("size", [2, 3])
def test_collectives_give_gloos_results_and_the_same_bits_on_every_rank(size: int, tmp_path: Path) -> None:
    """3 ranks on a 2-core machine: some rank is always off its core, so the waits sleep."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn_rank(_collectives, r, size, init_method, str(tmp_path)) for r in range(size)]
    join_ranks(procs)
    assert [p.exitcode for p in procs] == [0] * size, _errors(tmp_path)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    for key in got[0]:
        for r in range(1, size):
            assert torch.equal(got[r][key], got[0][key]), f"{key}: rank {r} differs from rank 0"
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 640, BIG):
            mine, gloo = got[0][f"reduce {dtype} {n}"], got[0][f"reduce gloo {dtype} {n}"]
            exact = sum(_data(r, n, dtype).double() for r in range(size))
            # float32 sums in rank order; gloo's order may differ from 3 ranks on
            tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
            torch.testing.assert_close(mine.double(), exact, rtol=tol, atol=tol)
            if size == 2 and dtype == torch.float32:  # one addition: the order cannot matter
                assert torch.equal(mine, gloo)
    rows = [_data(r, 3 * 700, torch.float32).reshape(3, 700) for r in range(size)]
    assert torch.equal(got[0]["gather"], torch.cat(rows, dim=-1))
    big_rows = [_data(r, BIG, torch.float32).reshape(1, BIG) for r in range(size)]
    assert torch.equal(got[0]["gather big"], torch.cat(big_rows, dim=0))
    for n in (6, BIG // 2 * 2):
        assert torch.equal(got[1][f"broadcast {n}"], torch.arange(n, dtype=torch.int64))
    leftovers = [p for p in SHM_DIR.glob("sluice-tp-*") if any(str(proc.pid) in p.name for proc in procs)]
    assert leftovers == [], "the segment's file is removed once every rank mapped it"


def _peer_fails(rank: int, how: str, init_method: str, workdir: str) -> None:
    out = Path(workdir) / f"rank{rank}.txt"
    try:
        init_tensor_parallel(rank, 2, init_method, torch.device("cpu"), timeout_s=2 if how == "hangs" else 120)
        assert tensor_model_parallel_all_reduce(torch.ones(4)).tolist() == [2.0] * 4
        if rank == 1:
            if how == "exits":
                os._exit(0)  # no teardown: as a killed rank
            time.sleep(60)  # hangs: alive, never joins the next collective
            return
        start = time.monotonic()
        try:
            tensor_model_parallel_all_reduce(torch.ones(4))
            out.write_text("returned")
        except RuntimeError as exc:
            out.write_text(f"{exc}\nafter {time.monotonic() - start:.1f} s")
        destroy_tensor_parallel(abandon=True)
    except BaseException:
        out.write_text(traceback.format_exc())
        raise


@pytest.mark.parametrize("how", ["exits", "hangs"])
def test_a_dead_or_hung_peer_fails_the_collective(how: str, tmp_path: Path) -> None:
    """A rank that exits is noticed by its pid (well before the 120 s timeout); one that
    hangs makes the collective time out, as gloo's does."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn_rank(_peer_fails, r, how, init_method, str(tmp_path)) for r in range(2)]
    try:
        procs[0].join(100)
        result = (tmp_path / "rank0.txt").read_text() if (tmp_path / "rank0.txt").exists() else "no answer"
    finally:
        join_ranks(procs, timeout_s=0)
    if how == "exits":
        assert "rank 1 (pid" in result and "has exited" in result, result
    else:
        assert "timed out" in result, result


def _gloo_only(rank: int, init_method: str, workdir: str) -> None:
    try:
        init_tensor_parallel(rank, 2, init_method, torch.device("cpu"), timeout_s=60, shm=False)
        total = tensor_model_parallel_all_reduce(torch.full((3,), float(rank + 1)))
        (Path(workdir) / f"rank{rank}.txt").write_text(f"{parallel_state._SHM} {total.tolist()}")
        destroy_tensor_parallel()
    except BaseException:
        (Path(workdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_disable_custom_all_reduce_keeps_gloo(tmp_path: Path) -> None:
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn_rank(_gloo_only, r, init_method, str(tmp_path)) for r in range(2)]
    join_ranks(procs)
    assert [p.exitcode for p in procs] == [0, 0], _errors(tmp_path)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["None [3.0, 3.0, 3.0]"] * 2


def _late_command(rank: int, init_method: str, workdir: str) -> None:
    try:
        init_tensor_parallel(rank, 2, init_method, torch.device("cpu"), timeout_s=1)
        x = torch.full((6,), 7 if rank == 0 else 0, dtype=torch.int64)
        if rank == 0:
            time.sleep(4)  # idle, or still starting: four of the group's timeouts
        got = broadcast_from_rank0(x, wait_forever=True)
        (Path(workdir) / f"rank{rank}.txt").write_text(str(got.tolist()))
        destroy_tensor_parallel()
    except BaseException:
        (Path(workdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_a_worker_waits_for_rank_0s_next_command_past_the_timeout(tmp_path: Path) -> None:
    """A worker rank's wait for the next command (tp_channel.receive) has no bound: rank 0
    may be idle, or still starting up after the worker is ready; its death still ends it."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn_rank(_late_command, r, init_method, str(tmp_path)) for r in range(2)]
    join_ranks(procs)
    assert [p.exitcode for p in procs] == [0, 0], _errors(tmp_path)
    assert (tmp_path / "rank1.txt").read_text() == str([7] * 6)

