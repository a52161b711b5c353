"""SamplingBatchInfo from a batch's requests (SGLang's SamplingBatchInfo.from_schedule_batch).

ScheduleBatch builds one per forward in `get_model_worker_batch`; the sampler reads it.

Invariants:
- `sampling_info_of` depends only on the requests, the forward mode, which rows
  extend a cached prefix, and the intermediate chunk: a decode batch over the same
  requests may reuse it (ScheduleBatch caches it until `reqs` change).
- A penalty reset that a request asks for once (`penalty_reset_pending`) is added on
  top by `with_pending_resets`, never into the reused info.
"""

from __future__ import annotations

import dataclasses

import torch

from runtime.managers.req import Req
from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.sampling_info import PenaltyReset, SamplingBatchInfo


def sampling_info_of(
    reqs: list[Req], mode: ForwardMode, prefix_slots: list[torch.Tensor | None], intermediate: Req | None = None
) -> SamplingBatchInfo:
    sps = [r.sampling_params for r in reqs]
    temps = [0.0 if sp.is_greedy else sp.temperature for sp in sps]
    penalized, rows, resets, stop_ids = [], [], [], []
    for i, (r, sp) in enumerate(zip(reqs, sps)):
        if (sp.has_penalty or sp.min_new_tokens > 0) and r is not intermediate:
            penalized.append(i)
            rows.append(r.row)
            stop_ids.append(sorted(r.stop_token_ids))
            if mode.is_extend() and prefix_slots[i] is not None:
                resets.append(PenaltyReset(r.row, r.origin_input_ids, list(r.output_ids)))
    psp = [sps[i] for i in penalized]
    return SamplingBatchInfo(
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
        penalized_rows=rows,
        frequency=torch.tensor([sp.frequency_penalty for sp in psp], dtype=torch.float32),
        presence=torch.tensor([sp.presence_penalty for sp in psp], dtype=torch.float32),
        repetition=torch.tensor([sp.repetition_penalty for sp in psp], dtype=torch.float32),
        min_new_tokens=torch.tensor([sp.min_new_tokens for sp in psp], dtype=torch.int64),
        stop_ids=stop_ids,
        resets=resets,
        # A chunk that does not end its prompt samples nothing real: no constraint there.
        grammars=[r.grammar if r is not intermediate else None for r in reqs] if any(r.grammar for r in reqs) else None,
        logit_bias=[(i, list(sp.logit_bias), list(sp.logit_bias.values())) for i, sp in enumerate(sps) if sp.logit_bias] or None,
    )


def with_pending_resets(reqs: list[Req], sampling: SamplingBatchInfo) -> SamplingBatchInfo:
    """`sampling` plus a penalty reset for each penalized request that asked for one
    (the worker never saw it); every request's pending flag is cleared."""
    penalized = {id(reqs[i]) for i in sampling.penalized}
    fresh = [r for r in reqs if r.penalty_reset_pending and id(r) in penalized]
    for r in reqs:
        r.penalty_reset_pending = False
    resets = [PenaltyReset(r.row, r.origin_input_ids, list(r.output_ids)) for r in fresh]
    return dataclasses.replace(sampling, resets=sampling.resets + resets)
