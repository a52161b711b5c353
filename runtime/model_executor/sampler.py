"""Sampler: logits -> next tokens (+ logprobs), with per-row penalty state.

Penalty state lives on the worker, indexed by request-pool row, because under
overlap the scheduler learns a token one round after the worker has used it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from kernels.sampling import filter_min_p, filter_top_k_top_p, sample_no_sync
from runtime.constrained import Grammar
from runtime.model_executor.sampling_info import SamplingBatchInfo


class SampleOutput(NamedTuple):
    next_token_ids: torch.Tensor  # [bs] int64
    token_logprobs: torch.Tensor | None  # [bs] float32, logprob of the chosen token
    top_logprobs: torch.Tensor | None  # [bs, k] float32
    top_ids: torch.Tensor | None  # [bs, k] int64
    # Prompt logprobs of the batch's prompt rows (model_executor/prompt_logprobs.py), if any.
    prompt_logprobs: torch.Tensor | None = None  # [R] float32
    prompt_top_logprobs: torch.Tensor | None = None  # [R, k] float32
    prompt_top_ids: torch.Tensor | None = None  # [R, k] int64


class PenaltyState:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.counts = torch.zeros((num_rows, vocab_size), dtype=torch.float32, device=device)  # output tokens
        self.seen = torch.zeros((num_rows, vocab_size), dtype=torch.bool, device=device)  # prompt + output
        self.generated = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def reset(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        dev = self.counts.device
        self.counts[row].zero_()
        self.seen[row].zero_()
        out = torch.tensor(output_ids, dtype=torch.int64, device=dev)
        self.counts[row].index_add_(0, out, torch.ones(len(output_ids), device=dev))
        self.seen[row, torch.tensor(prompt_ids + output_ids, dtype=torch.int64, device=dev)] = True
        self.generated[row] = len(output_ids)

    def apply(self, logits: torch.Tensor, info: SamplingBatchInfo) -> None:
        idx = torch.tensor(info.penalized, dtype=torch.int64, device=logits.device)
        rows = torch.tensor(info.penalized_rows, dtype=torch.int64, device=logits.device)
        dev = logits.device
        sub = logits[idx]
        rep = info.repetition.to(dev)[:, None]
        # HF/CTRL repetition penalty on every token seen in prompt or output.
        penalized = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(self.seen[rows], penalized, sub)
        counts = self.counts[rows]
        sub = sub - info.frequency.to(dev)[:, None] * counts - info.presence.to(dev)[:, None] * (counts > 0)
        below_min = self.generated[rows] < info.min_new_tokens.to(dev)
        for j, ids in enumerate(info.stop_ids):
            if ids:
                block = torch.tensor(ids, dtype=torch.int64, device=dev)
                sub[j, block] = torch.where(below_min[j], float("-inf"), sub[j, block])
        logits[idx] = sub

    def commit(self, info: SamplingBatchInfo, next_ids: torch.Tensor) -> None:
        idx = torch.tensor(info.penalized, dtype=torch.int64, device=next_ids.device)
        rows = torch.tensor(info.penalized_rows, dtype=torch.int64, device=next_ids.device)
        toks = next_ids[idx]
        self.counts[rows, toks] += 1
        self.seen[rows, toks] = True
        self.generated[rows] += 1


class Sampler:
    def __init__(
        self, num_rows: int, vocab_size: int, device: torch.device | str, argmax_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> None:
        """`argmax_rows`: the CPU kernels' argmax of float32 rows (torch's took 62 us of a
        bs 1 decode step, 500 us at bs 16); same answer, first maximum."""
        self.num_rows, self.vocab_size, self.device = num_rows, vocab_size, device
        self.argmax_rows = argmax_rows
        self.penalties: PenaltyState | None = None  # allocated on first use
        self._bitmask: torch.Tensor | None = None  # grammar masks, int32 [rows, ceil(vocab / 32)]

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo, top_logprobs_nums: list[int]) -> SampleOutput:
        logits = logits.float()
        for row, ids, biases in info.logit_bias or ():
            logits[row, ids] += torch.tensor(biases, device=logits.device)
        logprobs = torch.log_softmax(logits, dim=-1) if any(k >= 0 for k in top_logprobs_nums) else None
        if info.penalized:
            if self.penalties is None:
                self.penalties = PenaltyState(self.num_rows, self.vocab_size, self.device)
            for r in info.resets:
                self.penalties.reset(r.row, r.prompt_ids, r.output_ids)
            self.penalties.apply(logits, info)
        if info.grammars is not None:
            self._mask(logits, info.grammars)

        greedy = self.argmax_rows(logits) if self.argmax_rows is not None and logits.is_cpu else logits.argmax(dim=-1)
        if info.is_all_greedy:
            next_ids = greedy
        else:
            temps = info.temperatures.to(logits.device)
            probs = torch.softmax(logits / torch.where(temps > 0, temps, 1.0)[:, None], dim=-1)
            if info.need_top_k or info.need_top_p:
                probs = filter_top_k_top_p(
                    probs,
                    info.top_ks.to(logits.device) if info.need_top_k else None,
                    info.top_ps.to(logits.device) if info.need_top_p else None,
                )
            if info.need_min_p:
                probs = filter_min_p(probs, info.min_ps.to(logits.device))
            next_ids = torch.where(temps > 0, sample_no_sync(probs, info.generators), greedy)

        if info.penalized and self.penalties is not None:
            self.penalties.commit(info, next_ids)
        if info.grammars is not None:
            for grammar, token in zip(info.grammars, next_ids.tolist()):
                if grammar is not None:
                    grammar.accept(token)

        token_lp = top_lp = top_ids = None
        if logprobs is not None:
            token_lp = logprobs.gather(-1, next_ids[:, None])[:, 0]
            k = max(top_logprobs_nums)
            if k > 0:
                top_lp, top_ids = logprobs.topk(k, dim=-1)
        return SampleOutput(next_ids, token_lp, top_lp, top_ids)

    def _mask(self, logits: torch.Tensor, grammars: list[Grammar | None]) -> None:
        """-inf on every token the row's grammar forbids next (constrained rows only)."""
        import xgrammar

        rows = [i for i, g in enumerate(grammars) if g is not None]
        if self._bitmask is None or self._bitmask.shape[0] < len(grammars):
            self._bitmask = xgrammar.allocate_token_bitmask(max(len(grammars), 8), self.vocab_size)
        bitmask = self._bitmask[: len(grammars)]
        for i in rows:
            grammar = grammars[i]
            assert grammar is not None
            grammar.fill(bitmask, i)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)

