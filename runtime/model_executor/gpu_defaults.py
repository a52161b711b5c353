"""Defaults that depend on the GPU's memory, as SGLang derives them (tp_size 1).

Pure functions of a few numbers, so they are tested on CPU with made-up GPUs.

    GPU memory = weights + KV pool + activations + CUDA-graph buffers
    mem_fraction_static = (weights + KV pool) / GPU memory

The activation and graph reserve grows with `chunked_prefill_size` (the largest
prefill forward) and `cuda_graph_max_bs`, so those are chosen first, from the
memory tier, and the static fraction follows from them. The KV pool then gets
what the static fraction leaves once the weights are resident.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
GiB = 1 << 30

# (memory below this many GiB, chunked_prefill_size, cuda_graph_max_bs); SGLang's tiers.
MEMORY_TIERS: tuple[tuple[float, int, int], ...] = (
    (20, 2048, 8),  # T4, RTX 4080
    (35, 2048, 24),  # A10, RTX 4090 / 5090
    (60, 4096, 32),  # A100 40GB, L40
    (90, 8192, 256),  # H100, A100 80GB
    (160, 8192, 256),  # H200, H20
    (float("inf"), 16384, 512),  # B200, MI300
)
REQ_POOL_MIN_ROWS = 2048
REQ_POOL_MAX_ROWS = 4096
REQ_TABLE_BUDGET_BYTES = 512 * MiB  # cap on the int32 req_to_token table (host and device copy each)


@dataclass(frozen=True, slots=True)
class GpuMemoryDefaults:
    chunked_prefill_size: int  # -1 = chunking off
    cuda_graph_max_bs: int
    mem_fraction_static: float


def gpu_memory_defaults(
    total_bytes: int,
    chunked_prefill_size: int | None = None,
    cuda_graph_max_bs: int | None = None,
    mem_fraction_static: float | None = None,
    max_prefill_tokens: int = 16384,
) -> GpuMemoryDefaults:
    """Fill the three memory-shaped knobs the user left unset (None)."""
    mem_mib = total_bytes / MiB
    chunk, graph_bs = next((c, b) for limit, c, b in MEMORY_TIERS if mem_mib < limit * 1024)
    if chunked_prefill_size is not None:
        chunk = chunked_prefill_size
    if cuda_graph_max_bs is not None:
        graph_bs = cuda_graph_max_bs
    if mem_fraction_static is None:
        largest_prefill = chunk if chunk > 0 else max_prefill_tokens
        reserved_mib = 512.0  # attention workspaces and other constant metadata
        reserved_mib += max(largest_prefill, 2048) * 1.5  # activations of the largest prefill
        reserved_mib += graph_bs * 2  # CUDA-graph buffers
        reserved_mib += 1024 / 8  # SGLang's tp_size * pp_size / 8 GiB, at tp = pp = 1
        if mem_mib > 60 * 1024:
            reserved_mib = max(reserved_mib, 10 * 1024)
        mem_fraction_static = round((mem_mib - reserved_mib) / mem_mib, 3)
    return GpuMemoryDefaults(chunk, graph_bs, mem_fraction_static)


def kv_pool_tokens(free_bytes: int, total_bytes: int, mem_fraction_static: float, bytes_per_token: int, page_size: int) -> int:
    """KV tokens that fit, measured with the weights already resident (SGLang's
    profile_max_num_token): what is free minus the (1 - fraction) reserve, i.e.
    total * fraction - everything already allocated. Page-aligned; 0 if none fit."""
    budget = free_bytes - total_bytes * (1.0 - mem_fraction_static)
    tokens = int(max(budget, 0) // bytes_per_token)
    return tokens - tokens % page_size


def default_max_running_requests(max_total_tokens: int, context_len: int) -> int:
    """Rows of the request pool: SGLang's min(max(tokens / ctx * 512, 2048), 4096),
    at most half the KV tokens, and at most what keeps the int32 req_to_token table
    `[rows, context_len]` within REQ_TABLE_BUDGET_BYTES (long contexts)."""
    rows = min(max(int(max_total_tokens / context_len * 512), REQ_POOL_MIN_ROWS), REQ_POOL_MAX_ROWS)
    rows = min(rows, max(max_total_tokens // 2, 1))
    return max(1, min(rows, REQ_TABLE_BUDGET_BYTES // (4 * context_len)))


def default_cuda_graph_max_bs(tier_max_bs: int, max_running_requests: int) -> int:
    """No bucket larger than the batches the scheduler can form."""
    return max(1, min(tier_max_bs, max_running_requests))


__all__ = [
    "GiB",
    "GpuMemoryDefaults",
    "default_cuda_graph_max_bs",
    "default_max_running_requests",
    "gpu_memory_defaults",
    "kv_pool_tokens",
]
