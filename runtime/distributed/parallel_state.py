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


@dataclass(frozen=True, slots=True)
class TPInfo:
    rank: int
    size: int
    device: torch.device


_TP = TPInfo(rank=0, size=1, device=torch.device("cpu"))


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float) -> None:
    """Join the group of `size` ranks rendezvousing at `init_method` (tcp://host:port).

    `timeout_s` bounds every collective: a rank that dies or hangs makes the others'
    next collective raise instead of waiting forever."""
    global _TP
    if size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=timeout_s)
        )
    _TP = TPInfo(rank, size, device)


def destroy_tensor_parallel(abandon: bool = False) -> None:
    """Leave the group. `abandon`: a rank failed, so skip the teardown (which may wait
    on it); the process is about to exit and the OS reclaims the sockets."""
    global _TP
    if dist.is_initialized() and not abandon:
        dist.destroy_process_group()
    _TP = TPInfo(0, 1, _TP.device)


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


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
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank (in place; same shape and dtype on all ranks)."""
    if _TP.size > 1:
        dist.broadcast(x, src=0)
    return x
