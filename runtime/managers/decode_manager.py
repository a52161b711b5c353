"""DecodeManager: the running batch, the new-token ratio, and retraction.

Invariants:
- Every request in `running_batch` holds a row whose first `seq_len` slots have KV
  (or are being written by the forward in flight) and has finished its prefill.
- `new_token_ratio` (the share of each running request's remaining max_new_tokens
  that admission reserves) decays by one step per decode round toward its floor
  and jumps back to its start when a round has to retract.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from config.settings import EngineSettings
from runtime.managers.priority import PriorityRule
from runtime.managers.req import Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.scheduler_stats import LoadSnapshot, SchedulerStats
from runtime.mem.pools import MemoryPools
from runtime.model_executor.forward_batch import ForwardMode

log = structlog.get_logger("sluice.scheduler")

INIT_NEW_TOKEN_RATIO = 0.7  # share of max_new_tokens reserved per running request at first
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # floor = INIT * this * conservativeness
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # decode steps to decay from INIT to the floor


class DecodeManager:
    def __init__(self, settings: EngineSettings, pools: MemoryPools, stats: SchedulerStats) -> None:
        self.pools = pools
        self.stats = stats
        self.running_batch = self.empty_batch()
        conservativeness = settings.schedule_conservativeness
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio
        # Under the priority policy a decode round short of KV retracts the lowest priorities first.
        self.retract_rank = PriorityRule.of(settings).rank if settings.schedule_policy == "priority" else None

    def empty_batch(self) -> ScheduleBatch:
        return ScheduleBatch([], self.pools.req_to_token_pool, self.pools.allocator, self.pools.tree_cache)

    def merge_prefilled(self, last: ScheduleBatch, in_flight: bool, chunked_req: Req | None) -> None:
        """Requests whose prefill `last` ran join the running batch (not the chunked
        one, whose prompt is not done). With `in_flight` (overlap), `last` is still
        running: requests it brings to max_new_tokens end there and stay out."""
        tree_cache = self.pools.tree_cache
        # Prompts enter the tree as soon as their prefill is scheduled, so the
        # next batch already shares them (the worker runs forwards in order).
        for r in last.reqs[: last.batch_size() - len(last.decoding_reqs)]:
            if r.req_pool_idx is not None and not r.finished() and r is not chunked_req:
                r.row_dirty |= tree_cache.cache_unfinished_req(r)
        last.filter_batch([i for i, r in enumerate(last.reqs) if not r.finished() and r is not chunked_req and r.req_pool_idx is not None])
        if in_flight:
            last.drop_reqs_ending_in_flight()
        if last.is_empty():
            return
        if self.running_batch.is_empty():
            self.running_batch = last
        else:
            self.running_batch.merge_batch(last)
        self.running_batch.forward_mode = ForwardMode.DECODE

    def join_prebuilt(self, reqs: list[Req]) -> None:
        """Requests that hold a row with KV for their whole prompt (a prefill server
        computed it) and one output token join the running batch, as if prefilled here."""
        batch = ScheduleBatch(reqs, self.pools.req_to_token_pool, self.pools.allocator, self.pools.tree_cache, ForwardMode.EXTEND)
        batch.seq_lens = [len(r.origin_input_ids) for r in reqs]
        batch.next_input = [r.output_ids[-1] for r in reqs]  # known tokens, not futures
        for r in reqs:
            r.penalty_reset_pending = True  # the worker never saw this request
        self.merge_prefilled(batch, False, None)

    def mix_into(self, batch: ScheduleBatch) -> None:
        """Mixed chunk: the running decodes ride in prefill `batch` (extend length 1)
        when the KV pool can take their next tokens; the running batch is then empty."""
        running = self.running_batch
        running.filter_batch([i for i, r in enumerate(running.reqs) if not r.finished()])
        if not running.is_empty() and running.check_decode_mem():
            batch.mix_with_running(running)
            self.running_batch = self.empty_batch()
            self.stats.add("num_mixed_batches")

    def update_running_batch(self, snapshot: Callable[[], LoadSnapshot]) -> tuple[ScheduleBatch | None, list[Req]]:
        """The next decode batch, and the requests retracted to make room for it
        (they go back to the front of the waiting queue)."""
        batch = self.running_batch
        batch.filter_batch([i for i, r in enumerate(batch.reqs) if not r.finished()])
        if batch.is_empty():
            batch.batch_is_full = False
            return None, []
        retracted: list[Req] = []
        if not batch.check_decode_mem():
            held = {id(r): n for r, n in zip(batch.reqs, batch.seq_lens)}  # KV slots, for the traces
            retracted = batch.retract_decode(self.retract_rank)
            for r in retracted:
                r.trace.retracted(len(r.output_ids), held[id(r)])
            self.new_token_ratio = self.init_new_token_ratio
            self.stats.add("num_retracted_reqs_total", len(retracted))
            log.info("Retract requests.", retracted=len(retracted), running=batch.batch_size(), new_token_ratio=self.new_token_ratio)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.is_empty():
            return None, retracted
        batch.prepare_for_decode()
        self.stats.on_decode_step(snapshot)
        return batch, retracted
