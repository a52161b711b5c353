"""Prompt logprobs on the worker: the log-softmax of the logits at chosen prompt positions
(the scheduler's side is runtime/managers/prompt_logprobs.py).

Only the rows a prefill batch asked for (`ForwardInputs.prompt_logprob_rows`) are
projected onto the vocabulary, ROWS_PER_SLICE at a time: a request that asked nothing
costs nothing, and no forward holds more than [ROWS_PER_SLICE, vocab] float32 logits for
them (a 2048-token prompt at a 49k vocabulary would otherwise take 400 MB). The logits
are the model's own, before logit_bias, penalties and temperature (as HF's, and SGLang's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

ROWS_PER_SLICE = 256


class PromptLogprobOutput(NamedTuple):
    logprobs: torch.Tensor  # [R] float32: each row's logprob of its target token
    top_logprobs: torch.Tensor | None  # [R, k] float32, descending
    top_ids: torch.Tensor | None  # [R, k] int64


def compute(
    compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor | None, top_k: int
) -> PromptLogprobOutput | None:
    """`hidden`: [R, hidden] final hidden states of the rows; `targets`: [R] the token each
    row scores. A tensor-parallel rank other than 0 passes `targets=None`: it only joins the
    all-gathers of `compute_logits`, slice for slice, and gets None."""
    values, top_values, top_ids = [], [], []
    for lo in range(0, hidden.shape[0], ROWS_PER_SLICE):
        logits = compute_logits(hidden[lo : lo + ROWS_PER_SLICE])
        if targets is None:
            continue
        logprobs = torch.log_softmax(logits, dim=-1)
        values.append(logprobs.gather(-1, targets[lo : lo + ROWS_PER_SLICE, None])[:, 0])
        if top_k > 0:
            v, i = logprobs.topk(top_k, dim=-1)
            top_values.append(v)
            top_ids.append(i)
    if targets is None:
        return None
    return PromptLogprobOutput(
        torch.cat(values), torch.cat(top_values) if top_k > 0 else None, torch.cat(top_ids) if top_k > 0 else None
    )
