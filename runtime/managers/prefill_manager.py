"""PrefillManager: the waiting queue, the chunked request, and building prefill batches.

Invariants:
- A request in `waiting_queue` holds no row and no KV of its own (a retracted one
  gave both back); it may carry a matched prefix (`prefix_indices`, `last_node`)
  that nothing has locked yet.
- `chunked_req`, when set, holds a row and the KV of its computed chunks; its next
  chunk runs before any new request is admitted.
- With --enable-priority-preemption, a request refused for lack of KV or of a running
  slot may retract running requests of lower priority (priority.py); they join the
  waiting queue after the round's admissions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from config.settings import EngineSettings
from runtime.managers.priority import Preemption, PriorityRule
from runtime.managers.req import Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from runtime.managers.scheduler_stats import LoadSnapshot, SchedulerStats
from runtime.mem.pools import MemoryPools


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    batch: ScheduleBatch
    # Running decodes may ride along (ForwardMode.MIXED); the scheduler mixes them in.
    mix_running: bool


class PrefillManager:
    def __init__(self, settings: EngineSettings, pools: MemoryPools, stats: SchedulerStats) -> None:
        self.pools = pools
        self.page_size = settings.page_size
        self.max_prefill_tokens = settings.max_prefill_tokens
        self.chunked_prefill_size = None if settings.chunked_prefill_size in (None, -1) else settings.chunked_prefill_size
        self.enable_mixed_chunk = settings.enable_mixed_chunk
        self.policy = SchedulePolicy(settings.schedule_policy, pools.tree_cache, settings.random_seed,
                                     settings.schedule_low_priority_values_first)
        self.stats = stats
        self.preemption = Preemption(PriorityRule.of(settings), stats) if settings.enable_priority_preemption else None
        self.waiting_queue: list[Req] = []
        self.chunked_req: Req | None = None

    def _no_row(self, running: ScheduleBatch, admitted: int, max_running_requests: int, live: bool = False) -> bool:
        """Whether one more request than `admitted` would pass max_running_requests or the
        free rows. `live`: not counting running requests that finished (and hold no row)."""
        bs = sum(not r.finished() for r in running.reqs) if live else running.batch_size()
        return bs + admitted >= max_running_requests or admitted >= self.pools.req_to_token_pool.available_size()

    @staticmethod
    def release_waiting(req: Req) -> None:
        """Drop a waiting request's matched (unlocked) prefix."""
        req.prefix_indices = req.prefix_indices[:0]
        req.last_node = None

    def get_new_batch_prefill(
        self, running: ScheduleBatch, new_token_ratio: float, max_running_requests: int, snapshot: Callable[[], LoadSnapshot]
    ) -> PrefillBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running_bs = running.batch_size()
        full = running.batch_is_full or self._no_row(running, 0, max_running_requests)
        # A full batch is worth a round only for a waiting request that may preempt.
        if full and self.chunked_req is None and (
            self.preemption is None or not self.preemption.may_preempt(self.waiting_queue, running)
        ):
            running.batch_is_full = True
            return None

        tree_cache = self.pools.tree_cache
        prefix_done = self.policy.calc_priority(self.waiting_queue)
        mixed = self.enable_mixed_chunk and running_bs > 0
        if mixed and self.chunked_prefill_size is not None and self.chunked_prefill_size - running_bs < self.page_size:
            mixed = False  # leave the chunked request room to progress
        adder = PrefillAdder(
            self.page_size,
            tree_cache,
            self.pools.allocator,
            running,
            new_token_ratio,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            running_bs if mixed else 0,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)

        preempted: list[Req] = []
        for req in self.waiting_queue:
            no_row = self._no_row(running, len(adder.can_run_list), max_running_requests)
            if no_row and self.preemption is None:
                running.batch_is_full = True
                break
            if not prefix_done:
                req.init_next_round_input(tree_cache)
            result = AddReqResult.OTHER if no_row else adder.add_req(req)
            refused = no_row or (result == AddReqResult.NO_TOKEN and adder.can_run_list[-1:] != [req])
            if refused and self.preemption is not None:
                # A slot held only by a finished request frees this round: nothing to preempt for.
                need_row = no_row and self._no_row(running, len(adder.can_run_list), max_running_requests, live=True)
                victims = self.preemption.make_room(req, running, adder, need_row) if need_row or not no_row else []
                if victims:
                    preempted += victims
                    no_row = self._no_row(running, len(adder.can_run_list), max_running_requests)
                    result = AddReqResult.OTHER if no_row else adder.add_req(req)
            if result != AddReqResult.CONTINUE:
                if no_row or result == AddReqResult.NO_TOKEN:
                    running.batch_is_full = True
                break
        self.waiting_queue += preempted  # after the admissions: not readmitted this round

        can_run = adder.can_run_list
        if not can_run:
            return None
        admitted = {id(r) for r in can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        for r in self.waiting_queue:
            if prefix_done or r.last_node is not None:
                self.release_waiting(r)
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
            self.stats.add("num_chunked_prefills")
        for r in can_run:
            if r.first_scheduled_time is None:  # first prefill (not a later chunk or a re-prefill)
                r.cached_tokens = len(r.prefix_indices)
            # (Before prepare_for_extend: a request without a row is being admitted.)
            r.trace.prefill_chunk(r.extend_input_len, len(r.prefix_indices), len(can_run), running_bs,
                                  r is self.chunked_req, r.req_pool_idx is None)

        batch = ScheduleBatch(can_run, self.pools.req_to_token_pool, self.pools.allocator, tree_cache)
        batch.intermediate_chunk = self.chunked_req
        batch.prepare_for_extend()
        self.stats.log_prefill(snapshot(), len(can_run), adder.log_input_tokens, adder.log_hit_tokens, running_bs)
        return PrefillBatch(batch, mixed)
