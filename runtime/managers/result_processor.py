"""ResultProcessor: a generation forward's result, applied to its requests
(SGLang's process_batch_result).

Each request of the batch gets its token, is checked for a finish (EOS, stop ids,
max_new_tokens, stop strings, abort) and either ends through `finish` or has its
new output emitted. An embedding server's results go to the EmbeddingManager instead.

Invariants:
- A result speaks only for the requests as they were at launch (`batch.epochs`): a
  request retracted since gets nothing from it.
- A request that ends here ends once, through `finish`, with the KV its forward
  wrote (`seq_len` tokens); later positions have none.
- With overlap, a request that had already finished when this result arrives ran one
  step past its end: that step's KV slot goes back to the allocator here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from runtime.managers.req import FinishReason, Req, aborted
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.scheduler_output import OutputProcessor
from runtime.managers.scheduler_stats import SchedulerStats
from runtime.mem.allocator import TokenToKVPoolAllocator
from runtime.model_executor.worker import BatchResult


class ResultProcessor:
    def __init__(
        self,
        allocator: TokenToKVPoolAllocator,
        page_size: int,
        output: OutputProcessor,
        stats: SchedulerStats,
        finish: Callable[[Req, FinishReason, int], None],
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.output = output
        self.stats = stats
        self.finish = finish  # Scheduler.finish

    def token_reason(self, req: Req) -> FinishReason | None:
        """Why `req` ends with the token it just got (stop strings included), or None."""
        reason = req.check_finished()
        if reason is None and (stop := self.output.matched_stop(req)) is not None:
            reason = FinishReason("stop", stop)
        return reason

    def process_prebuilt(self, reqs: list[Req]) -> list[Req]:
        """Decode server: each request's prompt KV and first token came from a prefill
        server. Emit that token; end the requests it ends; return the others."""
        joining = []
        for req in reqs:
            req.has_prefilled, req.first_token_time = True, time.monotonic()
            req.trace.first_token()
            if req.grammar is not None:
                req.grammar.accept_later(req.output_ids[-1])  # sampled by the prefill server
            reason = self.token_reason(req)
            if reason is None and not self.output.emit(req):
                reason = aborted()  # the consumer is gone
            if reason is not None:
                self.finish(req, reason, len(req.origin_input_ids))
            else:
                joining.append(req)
        return joining

    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        token_pos = num_tokens = 0
        n_extend = batch.batch_size() - len(batch.decoding_reqs) if batch.forward_mode.is_extend() else 0
        output = self.output
        assert batch.out_cache_loc is not None
        if batch.prompt_lp is not None:  # before any request below ends and emits
            batch.prompt_lp.deliver(batch.reqs, batch.epochs, result)
        for i, req in enumerate(batch.reqs):
            token_pos += batch.extend_lens[i]
            if req.epoch != batch.epochs[i]:  # retracted after this forward was launched
                if req.grammar is not None:
                    req.grammar.rollback_later()  # the worker accepted the token dropped here
                continue
            if i < n_extend:
                if req.is_chunked > 0:
                    req.is_chunked -= 1
                    continue
                req.has_prefilled = True
                req.trace.prefilled()
            if req.finished():
                # Overlap ran one step past the finish: return that step's KV slot
                # unless it shares the (already released) tail page.
                if (batch.seq_lens[i] - 1) % self.page_size == 0:
                    self.allocator.free(batch.out_cache_loc[token_pos - 1 : token_pos])
                continue
            reason: FinishReason | None
            if req.to_abort:
                reason = req.abort_reason or aborted()
            elif req.sampling_params.max_new_tokens == 0:  # prefill only (prompt logprobs): no token kept
                reason = req.check_finished()
            else:  # every other forward yields one token
                num_tokens += 1
                req.output_ids.append(result.next_token_ids[i])
                if req.return_logprob:
                    req.append_logprobs(result, i)
                reason = self.token_reason(req)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
                if req.output_ids:  # (an abort gets no token)
                    req.trace.first_token()
            if reason is not None:
                # This forward wrote KV for positions < seq_len; later ones have none.
                self.finish(req, reason, batch.seq_lens[i])
            elif not output.emit(req):
                req.to_abort = True  # the consumer is gone: end it at its next result
                req.trace.abort_requested("consumer_gone")
        self.stats.add("generation_tokens_total", num_tokens)
