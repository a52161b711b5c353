"""Req: one generation request as the scheduler sees it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime.managers.io_struct import BootstrapInfo, FinishReasonJSON
from runtime.managers.prompt_logprobs import PromptLogprobs
from runtime.managers.trace import RequestTrace
from runtime.model_executor.worker import BatchResult
from runtime.sampling_params import SamplingParams
from runtime.token_roles import Span, role_switches

if TYPE_CHECKING:
    from runtime.constrained import Grammar
    from runtime.mem.prefix_cache import PrefixCache, TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(slots=True)
class FinishReason:
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    message: str | None = None
    status_code: int | None = None  # set when the server, not the client, ended the request

    def to_json(self) -> FinishReasonJSON:
        out: FinishReasonJSON = {"type": self.type, "matched": self.matched}
        if self.message:
            out["message"] = self.message
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


def aborted(message: str = "aborted") -> FinishReason:
    return FinishReason("abort", message=message)


class Req:
    """State of one request across scheduling rounds.

    `fill_ids` is what the next prefill covers (prompt + output so far, cut to a
    chunk); `prefix_indices` are the KV slots of its cached prefix; the request's
    row `req_pool_idx` holds slots for `[0, len(fill_ids))` once it has run.
    """

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        priority: int = 0,
        bootstrap: BootstrapInfo | None = None,
        logprob_start_len: int = -1,
        answer_spans: Sequence[Span] = (),
    ) -> None:
        self.rid = rid
        self.origin_input_ids = input_ids
        self.output_ids: list[int] = []
        # Where its tokens' role flips between given text and answers (runtime/token_roles.py).
        self.role_switches = role_switches(len(input_ids), answer_spans)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            self.stop_token_ids |= set(eos_token_ids)
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        # SGLang's logprob_start_len: -1 = no prompt logprobs, else from that prompt position on.
        self.prompt_logprobs = PromptLogprobs(logprob_start_len, len(input_ids), top_logprobs_num) if logprob_start_len >= 0 else None
        self.priority = priority
        self.bootstrap = bootstrap  # prefill/decode disaggregation: where its KV goes or comes from
        self.grammar: Grammar | None = None  # its output constraint, once compiled (GrammarManager)

        # Scheduling state.
        self.fill_ids: list[int] = []
        self.prefix_indices: torch.Tensor = _EMPTY
        self.extend_input_len = 0
        self.last_node: TreeNode | None = None
        self.req_pool_idx: int | None = None
        # The scheduler rewrote this row's prefix (cache_unfinished_req found some of
        # its slots already in the tree); the worker's copy needs it before the next
        # forward that reads the row.
        self.row_dirty = False
        # The worker's penalty state for this row was never built (a decode server got
        # the prompt's KV from a prefill server): the next decode rebuilds it.
        self.penalty_reset_pending = False
        self.is_chunked = 0  # >0 while the request is the scheduler's chunked_req
        self.epoch = 0  # bumped on retraction: results of forwards launched before are stale
        self.cached_tokens = 0  # prompt tokens that came from the radix cache (first prefill)
        self.has_prefilled = False
        self.to_abort = False
        self.abort_reason: FinishReason | None = None  # set when the server ends it (else the client did)
        self.finished_reason: FinishReason | None = None
        self.generator: torch.Generator | None = None

        # Results.
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []

        # Timing (time.monotonic seconds).
        self.arrival_time = time.monotonic()
        self.trace = RequestTrace(rid, self.arrival_time, len(input_ids))  # its timeline (trace.py)
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # ---- lengths -------------------------------------------------------------
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def row(self) -> int:
        """The request's req_to_token row; only while it holds one."""
        assert self.req_pool_idx is not None, f"{self.rid} holds no row"
        return self.req_pool_idx

    def finished(self) -> bool:
        return self.finished_reason is not None

    def init_next_round_input(self, tree_cache: PrefixCache | None = None) -> None:
        """Recompute fill_ids; with a tree, re-match the longest cached prefix.

        At least one token is always left to compute, so the forward yields logits; and no
        prompt position whose logprobs are still to be computed comes from the cache.
        """
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            limit = len(self.fill_ids) - 1
            if self.prompt_logprobs is not None and (scored := self.prompt_logprobs.prefix_limit()) is not None:
                limit = min(limit, scored)
            self.prefix_indices, self.last_node = tree_cache.match_prefix(tree_cache.key(self, self.fill_ids[:limit]))
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    # ---- stop conditions ---------------------------------------------------------
    def check_finished(self) -> FinishReason | None:
        """Token-level stop conditions after a new token (stop strings are the
        OutputProcessor's). Returns the reason; the scheduler's `finish` applies it."""
        sp = self.sampling_params
        n_out = len(self.output_ids)
        if n_out >= sp.max_new_tokens:
            return FinishReason("length", sp.max_new_tokens)
        if n_out == 0 or n_out < sp.min_new_tokens:
            return None
        last = self.output_ids[-1]
        return FinishReason("stop", last) if last in self.stop_token_ids else None

    def append_logprobs(self, result: BatchResult, i: int) -> None:
        """Record the logprobs of this request's token `i` of `result`, if computed."""
        if result.token_logprobs is None:
            return
        self.output_token_logprobs.append((result.token_logprobs[i], result.next_token_ids[i]))
        if self.top_logprobs_num > 0 and result.top_logprobs is not None and result.top_ids is not None:
            k = self.top_logprobs_num
            self.output_top_logprobs.append(list(zip(result.top_logprobs[i][:k], result.top_ids[i][:k])))

    def reset_for_retract(self) -> None:
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.extend_input_len = 0
        self.req_pool_idx = None
        self.row_dirty = False
        self.epoch += 1
        if self.prompt_logprobs is not None:  # results still in flight are stale now
            self.prompt_logprobs.rewind()

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
