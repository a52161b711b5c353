"""SamplingBatchInfo: a batch's sampling parameters as tensors (built by the scheduler
from its requests in `runtime.managers.sampling_batch`, read by the sampler)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.constrained import Grammar


@dataclass(slots=True)
class PenaltyReset:
    """Rebuild the worker's per-row penalty state from the request's history."""

    row: int
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(slots=True)
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs] float32; 0 marks a greedy row
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64; -1 = off
    min_ps: torch.Tensor  # [bs] float32
    is_all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    generators: list[torch.Generator | None]  # per-request seeded RNGs
    # Rows with penalties or min_new_tokens: batch index -> params.
    penalized: list[int]
    penalized_rows: list[int]
    frequency: torch.Tensor  # [len(penalized)]
    presence: torch.Tensor
    repetition: torch.Tensor
    min_new_tokens: torch.Tensor  # [len(penalized)] int64
    stop_ids: list[list[int]]  # tokens blocked until min_new_tokens is reached
    resets: list[PenaltyReset]
    # (row, token ids, biases) of the rows with a logit_bias.
    logit_bias: list[tuple[int, list[int], list[float]]] | None = None
    # Per row, the request's output constraint (None: unconstrained); None when no row has one.
    grammars: list[Grammar | None] | None = None
