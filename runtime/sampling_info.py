"""SamplingBatchInfo: a batch's sampling parameters as tensors, built on the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.forward_batch import ForwardMode

if TYPE_CHECKING:
    from runtime.req import Req


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

    @classmethod
    def from_reqs(cls, reqs: list[Req], mode: ForwardMode, prefix_slots: list[torch.Tensor | None]) -> SamplingBatchInfo:
        sps = [r.sampling_params for r in reqs]
        temps = [0.0 if sp.is_greedy else sp.temperature for sp in sps]
        penalized, rows, resets, stop_ids = [], [], [], []
        for i, (r, sp) in enumerate(zip(reqs, sps)):
            if (sp.has_penalty or sp.min_new_tokens > 0) and not r.is_chunked:
                penalized.append(i)
                rows.append(r.req_pool_idx)
                stop_ids.append(sorted(r.stop_token_ids))
                if mode.is_extend() and prefix_slots[i] is not None:
                    resets.append(PenaltyReset(r.req_pool_idx, r.origin_input_ids, list(r.output_ids)))  # type: ignore[arg-type]
        psp = [sps[i] for i in penalized]
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32),
            top_ps=torch.tensor([sp.top_p for sp in sps], dtype=torch.float32),
            top_ks=torch.tensor([sp.top_k for sp in sps], dtype=torch.int64),
            min_ps=torch.tensor([sp.min_p for sp in sps], dtype=torch.float32),
            is_all_greedy=all(t == 0.0 for t in temps),
            need_top_p=any(sp.top_p < 1.0 for sp in sps),
            need_top_k=any(sp.top_k > 1 for sp in sps),
            need_min_p=any(sp.min_p > 0.0 for sp in sps),
            generators=[r.generator for r in reqs],
            penalized=penalized,
            penalized_rows=rows,  # type: ignore[arg-type]
            frequency=torch.tensor([sp.frequency_penalty for sp in psp], dtype=torch.float32),
            presence=torch.tensor([sp.presence_penalty for sp in psp], dtype=torch.float32),
            repetition=torch.tensor([sp.repetition_penalty for sp in psp], dtype=torch.float32),
            min_new_tokens=torch.tensor([sp.min_new_tokens for sp in psp], dtype=torch.int64),
            stop_ids=stop_ids,
            resets=resets,
        )
