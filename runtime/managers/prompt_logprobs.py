"""Prompt logprobs (SGLang's `input_token_logprobs`): what a request asked for, what its
prefills have computed, and which prompt positions the next prefill batch must score.

A request asking from prompt position `start` (SGLang's `logprob_start_len`) gets one entry
per prompt token from `start` on: `(None, token)` for the token at `start` (SGLang pads the
first entry so), then `(logprob of token i given tokens < i, token i)` for every i > start.
The logprob of token i is read off the logits at position i - 1, so the prefills must
compute the logits of positions [start, n - 1) of an n-token prompt (position n - 1's are
the ones the first output token is sampled from).

Invariants:
- `scheduled` is the first position no batch built so far scores; `values` holds the
  results for positions [start, start + len(values)), appended in launch order.
- While positions are left to schedule, the request never takes a cached prefix longer than
  `scheduled` (`prefix_limit`): a cached token's logits were never computed here.
- A retraction makes the results of forwards launched before it stale (their epoch is
  dropped by `deliver`); `rewind` moves `scheduled` back to what has arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime.managers.io_struct import PromptTokenLogprob, TokenLogprob
from runtime.model_executor.worker import BatchResult


class PromptLogprobs:
    __slots__ = ("start", "end", "top_k", "scheduled", "values", "tops", "sent")

    def __init__(self, start: int, prompt_len: int, top_k: int) -> None:
        assert 0 <= start < prompt_len, "checked by make_req"
        self.start = start
        self.end = prompt_len - 1  # positions [start, end) are scored
        self.top_k = top_k
        self.scheduled = start
        self.values: list[float] = []
        self.tops: list[list[TokenLogprob]] = []
        self.sent = False

    def prefix_limit(self) -> int | None:
        """The longest cached prefix the request may reuse now (None: any)."""
        return self.scheduled if self.scheduled < self.end else None

    def schedule(self, prefix_len: int, extend_len: int) -> tuple[int, int]:
        """A prefill computes positions [prefix_len, prefix_len + extend_len): the offset in
        that extend of the first position to score, and how many to score from there."""
        lo, hi = max(prefix_len, self.scheduled), min(prefix_len + extend_len, self.end)
        if hi <= lo:
            return 0, 0
        assert prefix_len <= self.scheduled, f"a cached prefix ({prefix_len}) skipped unscored positions ({self.scheduled})"
        self.scheduled = hi
        return lo - prefix_len, hi - lo

    def rewind(self) -> None:
        self.scheduled = self.start + len(self.values)

    @property
    def complete(self) -> bool:
        return self.start + len(self.values) >= self.end

    def take(self, prompt_ids: list[int]) -> tuple[list[PromptTokenLogprob], list[list[TokenLogprob] | None]]:
        """The entries and top alternatives (empty without top_k) of tokens [start, n), once
        all have arrived; afterwards (and before) nothing: output chunks are deltas."""
        if self.sent or not self.complete:
            return [], []
        self.sent = True
        ids = prompt_ids[self.start :]
        entries: list[PromptTokenLogprob] = [(None, ids[0])]
        entries.extend(zip(self.values, ids[1:]))
        tops: list[list[TokenLogprob] | None] = [None, *self.tops] if self.top_k > 0 else []
        return entries, tops


class ScoringReq(Protocol):
    """What the batch-level helpers read of a request (runtime's Req)."""

    origin_input_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    epoch: int


@dataclass(slots=True)
class PromptLogprobRows:
    """The prompt positions one prefill batch scores. `rows` index the batch's packed new
    tokens; `targets[j]` is the prompt token row j scores (the one after it); `counts[i]`
    is how many rows request i has. Extending requests come first in a batch (a MIXED
    batch appends its decodes), so `counts` covers the first len(counts) requests."""

    counts: list[int]
    rows: list[int]
    targets: list[int]
    top_k: int  # the most top alternatives any of these requests asked for

    @staticmethod
    def plan(reqs: Sequence[ScoringReq], prefix_lens: list[int], extend_lens: list[int]) -> PromptLogprobRows | None:
        """Schedule the positions each request still needs from this prefill; None if none does."""
        counts, rows, targets, top_k, start = [], [], [], 0, 0
        for req, p, n in zip(reqs, prefix_lens, extend_lens):
            lp, count = req.prompt_logprobs, 0
            if lp is not None and lp.prefix_limit() is not None:
                offset, count = lp.schedule(p, n)
                rows.extend(range(start + offset, start + offset + count))
                targets.extend(req.origin_input_ids[p + offset + 1 : p + offset + 1 + count])
                top_k = max(top_k, lp.top_k if count else 0)
            counts.append(count)
            start += n
        return PromptLogprobRows(counts, rows, targets, top_k) if rows else None

    def deliver(self, reqs: Sequence[ScoringReq], epochs: list[int], result: BatchResult) -> None:
        """Hand each request its rows' results (a retracted request's are stale: dropped)."""
        values, top_lps, top_ids = result.prompt_logprobs, result.prompt_top_logprobs, result.prompt_top_ids
        assert values is not None and len(values) == len(self.rows), "the worker skipped prompt logprobs"
        pos = 0
        for req, epoch, count in zip(reqs, epochs, self.counts):
            lp = req.prompt_logprobs
            if count and lp is not None and req.epoch == epoch:
                lp.values.extend(values[pos : pos + count])
                if lp.top_k > 0 and top_lps is not None and top_ids is not None:
                    k = lp.top_k
                    lp.tops.extend(list(zip(v[:k], t[:k])) for v, t in zip(top_lps[pos : pos + count], top_ids[pos : pos + count]))
            pos += count
