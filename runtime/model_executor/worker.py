"""The Worker seam: what the scheduler hands a forward and what comes back.

ModelWorkerBatch is a snapshot of a ScheduleBatch holding only what one forward
needs, so the scheduler can go on mutating its batch while the forward runs
(overlap). BatchResult is one sampled token per request, on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.future_map import FutureMap
from runtime.model_executor.sampling_info import SamplingBatchInfo


@dataclass(slots=True)
class ForwardInputs:
    """What every tensor-parallel rank needs to run one forward (rank 0 broadcasts it)."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64; negative ids are futures the worker resolves
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: list[int]
    seq_lens: list[int]
    extend_prefix_lens: list[int]
    extend_seq_lens: list[int]
    # For each extending request, the slots of row[:prefix] to (re)write in the
    # worker's req_to_token; None for requests that extend by one decode token.
    prefix_slots: list[torch.Tensor | None]
    # (row, slots of row[:len]) the scheduler rewrote since the worker last saw the
    # row; applied before this batch's own writes.
    row_syncs: list[tuple[int, torch.Tensor]]
    # Prompt logprobs: the packed token indices whose logits are projected for them
    # (every rank joins those all-gathers; runtime/managers/prompt_logprobs.py).
    prompt_logprob_rows: list[int] = field(default_factory=list, kw_only=True)
    # Each request's role_switches: deterministic inference runs given tokens and answers
    # on different kernels (runtime/token_roles.py; batch_invariant.py PromptRows).
    role_switches: list[tuple[int, ...]] = field(default_factory=list, kw_only=True)


@dataclass(slots=True)
class ModelWorkerBatch(ForwardInputs):
    """ForwardInputs plus what only the sampling rank needs."""

    sampling: SamplingBatchInfo
    future_ids: torch.Tensor  # [bs] negative ids under which this batch's next tokens are stored
    top_logprobs_nums: list[int]  # -1 = no logprobs for that request
    return_logprob: bool = False
    prompt_logprob_targets: list[int] = field(default_factory=list)  # the token each prompt row scores
    prompt_top_k: int = 0  # top alternatives per prompt row


@dataclass(slots=True)
class BatchResult:
    next_token_ids: list[int]  # [bs]
    token_logprobs: list[float] | None = None  # [bs]
    top_logprobs: list[list[float]] | None = None  # [bs][k]
    top_ids: list[list[int]] | None = None
    # Per prompt_logprob_rows entry: the target's logprob, and the top alternatives.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    prompt_top_ids: list[list[int]] | None = None


class Worker(Protocol):
    """Runs forwards strictly in launch order (ModelRunner; StubWorker in tests and bench)."""

    @property
    def device(self) -> torch.device: ...

    def attach_future_map(self, futures: FutureMap) -> None: ...

    def launch(self, executor: Executor, mwb: ModelWorkerBatch) -> Future[BatchResult]:
        """Start the forward of `mwb`; the future completes with its sampled tokens."""
        ...

    def close(self) -> None: ...

    def kv_buffers(self) -> list[torch.Tensor]:
        """Every KV tensor of this worker, each indexed by KV slot in dim 0 (for moving a
        request's KV between servers: prefill/decode disaggregation)."""
        ...


Upload = Callable[[torch.Tensor | list[int], torch.dtype], torch.Tensor]


def write_req_to_token(table: torch.Tensor, mwb: ForwardInputs, out_cache_loc: torch.Tensor, upload: Upload) -> None:
    """Apply `mwb`'s writes to the worker's copy of req_to_token, before its forward:
    row syncs first, then each extend's prefix and new slots, then decode slots."""
    start = 0
    for row, slots in mwb.row_syncs:
        table[row, : slots.numel()] = upload(slots, torch.int32)
    decode_rows: list[int] = []
    decode_pos: list[int] = []
    decode_tok: list[int] = []
    for i, (row, p, n) in enumerate(zip(mwb.req_pool_indices, mwb.extend_prefix_lens, mwb.extend_seq_lens)):
        prefix = mwb.prefix_slots[i]
        if prefix is None:
            decode_rows.append(row)
            decode_pos.append(p)
            decode_tok.append(start)
        else:
            if p:
                table[row, :p] = upload(prefix, torch.int32)
            table[row, p : p + n] = out_cache_loc[start : start + n].to(torch.int32)
        start += n
    if decode_rows:
        i64 = torch.int64
        # An all-decode batch's tokens are out_cache_loc itself, in order.
        new = out_cache_loc if len(decode_tok) == out_cache_loc.numel() else out_cache_loc[upload(decode_tok, i64)]
        table[upload(decode_rows, i64), upload(decode_pos, i64)] = new.to(torch.int32)
