"""Who this process is in the tensor-parallel group, and the collectives layers use.

Every rank holds one shard of the model; the process group is the world (tensor
parallelism is the only parallelism inside one server; data parallelism is
replicas behind sglang-router). Before `init_tensor_parallel` (or with tp_size 1)
the functions below are identities, so single-process code pays nothing.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.distributed.shm_comm import ShmGroup, open_shm_group


@dataclass(frozen=True, slots=True)
class TPInfo:
    rank: int
    size: int
    device: torch.device


_TP = TPInfo(rank=0, size=1, device=torch.device("cpu"))
_SHM: ShmGroup | None = None  # the ranks' collectives in shared memory (one machine, CPU), else gloo's

# How long the ranks may take to meet. Rank 0's store waits for processes that are still
# importing torch and loading a shard (seconds on a slow CPU) or for nodes started by hand,
# so the rendezvous has its own, longer bound than a collective's.
RENDEZVOUS_TIMEOUT_S = 600.0


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float, shm: bool = True
) -> None:
    """Join the group of `size` ranks rendezvousing at `init_method` (tcp://host:port).

    `timeout_s` bounds every collective: a rank that dies or hangs makes the others'
    next collective raise instead of waiting forever. Meeting the other ranks may take
    up to max(timeout_s, RENDEZVOUS_TIMEOUT_S). `shm`: on CPU, run the collectives in
    shared memory where every rank is on this machine (runtime/distributed/shm_comm.py)."""
    global _TP, _SHM
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        host, port = _host_port(init_method)
        store = dist.TCPStore(
            host, port, world_size=size, is_master=rank == 0,
            timeout=datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S)),
        )
        try:
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
            )
        except BaseException:
            # A group that failed half-built still advanced torch's group counter, which
            # names the store keys ("0", "1", ...): a later group in this process would wait
            # on keys a fresh rank never writes. Every rank of a new group starts at 0.
            if not dist.is_initialized():
                dist.distributed_c10d._world.group_count = 0
            raise
        if shm and device.type == "cpu":
            _SHM = open_shm_group(store, rank, size, timeout_s)
    _TP = TPInfo(rank, size, device)


def _host_port(init_method: str) -> tuple[str, int]:
    """tcp://HOST:PORT (HOST may be a bracketed IPv6 address) -> (HOST, PORT)."""
    if not init_method.startswith("tcp://"):
        raise ValueError(f"{init_method!r}: the tensor-parallel rendezvous must be tcp://HOST:PORT")
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def destroy_tensor_parallel(abandon: bool = False) -> None:
    """Leave the group. `abandon`: a rank failed, so skip the teardown (which may wait
    on it); the process is about to exit and the OS reclaims the sockets."""
    global _TP, _SHM
    if dist.is_initialized() and not abandon:
        dist.destroy_process_group()
    _TP, _SHM = TPInfo(0, 1, _TP.device), None


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


def shm_group() -> ShmGroup | None:
    """The ranks' shared-memory collectives, where they run (kernels that call the
    all-reduce themselves take it: kernels/cpu/decode_stack.cpp)."""
    return _SHM


def get_tp_device() -> torch.device:
    """Where this rank's collectives run (NCCL needs CUDA tensors; gloo takes CPU ones)."""
    return _TP.device


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks (in place when tp_size > 1)."""
    if _TP.size == 1:
        return x
    if _SHM is not None and _SHM.serves(x, reduce=True):
        _SHM.all_reduce_(x)
    else:
        dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if _TP.size == 1:
        return x
    if _SHM is not None and _SHM.serves(x):
        return torch.cat(_SHM.all_gather(x).unbind(0), dim=dim)
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_from_rank0(x: torch.Tensor, wait_forever: bool = False) -> torch.Tensor:
    """Rank 0's `x` on every rank (in place; same shape and dtype on all ranks).

    `wait_forever`: a worker rank waiting for rank 0's next command, which may come
    after any idle time. In shared memory the wait has no bound (rank 0's death still
    fails it); gloo's keeps the group's timeout, which rank 0's idle heartbeats reset."""
    if _TP.size > 1 and _SHM is not None and _SHM.serves(x):
        _SHM.broadcast_(x, 0, forever=wait_forever)
    elif _TP.size > 1:
        dist.broadcast(x, src=0)
    return x
