"""Scheduler: the coroutine that owns waiting_queue, running_batch and chunked_req.

Each round: get_next_batch_to_run() -> launch the forward on the worker executor
-> process_batch_result(). With overlap on, round N+1's batch is built and
launched before round N's result is processed, so the worker never waits on
the scheduler; inputs that depend on round N are future ids (see future_map.py).
"""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog

from config.settings import EngineSettings
from runtime.forward_batch import ForwardMode
from runtime.future_map import FutureMap
from runtime.req import FinishReason, Req
from runtime.schedule_batch import ScheduleBatch
from runtime.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy
from runtime.scheduler_output import BatchResult, OutputProcessor
from runtime.scheduler_stats import SchedulerStats

log = structlog.get_logger("sluice.scheduler")

INIT_NEW_TOKEN_RATIO = 0.7  # share of max_new_tokens reserved per running request at first
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # floor = INIT * this * conservativeness
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # decode steps to decay from INIT to the floor


class Scheduler:
    def __init__(
        self,
        settings: EngineSettings,
        pools: Any,  # runtime.engine_setup.Pools
        runner: Any,  # runtime.model_runner.ModelRunner
        output: OutputProcessor,
    ) -> None:
        self.settings = settings
        self.req_to_token_pool = pools.req_to_token_pool
        self.allocator = pools.allocator
        self.tree_cache = pools.tree_cache
        self.max_total_num_tokens = pools.max_total_num_tokens
        self.max_running_requests = settings.max_running_requests or 1
        self.page_size = settings.page_size
        self.runner = runner
        self.output = output
        self.policy = SchedulePolicy(settings.schedule_policy, self.tree_cache, settings.random_seed)
        self.futures = FutureMap(capacity=4 * self.max_running_requests + 4 * (settings.max_prefill_tokens + 8), device=runner.device)
        runner.attach_future_map(self.futures)
        self.chunked_prefill_size = None if settings.chunked_prefill_size in (None, -1) else settings.chunked_prefill_size
        self.enable_overlap = not settings.disable_overlap_schedule

        self.waiting_queue: list[Req] = []
        self.running_batch = self._empty_batch()
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        self.reqs_by_rid: dict[str, Req] = {}

        conservativeness = settings.schedule_conservativeness
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-worker")
        self._wake = asyncio.Event()
        self._stopped = False
        self.inflight = 0  # forwards launched but not yet processed
        self._idle = asyncio.Event()
        self.stats = SchedulerStats(settings.decode_log_interval)

    def _empty_batch(self) -> ScheduleBatch:
        return ScheduleBatch([], self.req_to_token_pool, self.allocator, self.tree_cache)

    # ---- requests in/out --------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.reqs_by_rid[req.rid] = req
        self.waiting_queue.append(req)
        self._wake.set()

    def abort(self, rid: str | None = None) -> None:
        """Abort one request (or all with rid=None). Waiting ones end now; running
        ones end at their next result, which frees their KV."""
        targets = list(self.reqs_by_rid.values()) if rid is None else [self.reqs_by_rid.get(rid)]
        for req in targets:
            if req is None or req.finished():
                continue
            req.to_abort = True
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
                req.finished_reason = FinishReason("abort", message="aborted")
                self._release_waiting(req)
                self._on_finished(req)
                self.output.emit(req)
        self._wake.set()

    def _release_waiting(self, req: Req) -> None:
        """A waiting request may still borrow a radix prefix (policy matching)."""
        req.prefix_indices = req.prefix_indices[:0]
        req.last_node = None

    @property
    def num_running_reqs(self) -> int:
        n = self.running_batch.batch_size() + (1 if self.chunked_req else 0)
        if self.last_batch is not None and self.last_batch.forward_mode.is_extend():
            n += sum(1 for r in self.last_batch.reqs if not r.finished() and r is not self.chunked_req)
        return n

    def is_idle(self) -> bool:
        return not self.reqs_by_rid

    def bind_loop(self) -> None:
        """Called on the loop the scheduler will run on."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()

    async def wait_idle(self) -> None:
        """Until no request is alive and no forward is in flight."""
        while not (self._idle.is_set() and self.is_idle()):
            await self._idle.wait()
            await asyncio.sleep(0)

    def flush_cache(self) -> bool:
        """Evict the whole prefix cache. Refused while any request is alive.

        Eviction returns the tree's slots through the allocator, so a leaked slot
        stays visible as missing from available_size() afterwards."""
        if not self.is_idle() or self.inflight or self.chunked_req is not None or not self.running_batch.is_empty():
            return False
        self.tree_cache.evict(self.tree_cache.total_size())
        assert self.tree_cache.total_size() == 0, "locked nodes remain with no request alive"
        self.tree_cache.reset()
        self.last_batch = None
        return True

    def server_info(self) -> dict[str, Any]:
        return self.stats.server_info(self)

    # ---- the loop ----------------------------------------------------------------
    async def event_loop(self) -> None:
        while not self._stopped:
            pending: collections.deque[tuple[ScheduleBatch, Future[BatchResult]]] = collections.deque()
            try:
                await self._run_rounds(pending)
            except Exception as exc:  # never leave callers hanging on a dead scheduler
                log.exception("scheduler round failed; aborting every request", error=str(exc))
                for _, fut in pending:
                    if not fut.cancel():
                        fut.exception()
                self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        reqs = list(self.reqs_by_rid.values())
        self.waiting_queue, self.running_batch, self.chunked_req, self.last_batch = [], self._empty_batch(), None, None
        self.req_to_token_pool.clear()
        self.allocator.clear()
        self.tree_cache.reset()
        self.inflight = 0
        for req in reqs:
            req.finished_reason = FinishReason("abort", message=f"internal error: {exc}")
            self._on_finished(req)
            self.output.emit(req)

    async def _run_rounds(self, pending: collections.deque[tuple[ScheduleBatch, Future[BatchResult]]]) -> None:
        while not self._stopped:
            batch = self.get_next_batch_to_run()
            if batch is not None:
                pending.append(self._launch(batch))
            # With overlap, the previous batch is processed while this one runs.
            depth = 1 if self.enable_overlap and batch is not None else 0
            while len(pending) > depth:
                done_batch, fut = pending.popleft()
                result = await asyncio.wrap_future(fut)
                self.process_batch_result(done_batch, result)
            self.last_batch = batch
            self.inflight = len(pending)
            if batch is None and not pending and not self._stopped:
                if not self.waiting_queue and self.running_batch.is_empty() and self.chunked_req is None:
                    # Nothing can change without an add_request/abort/stop, each of
                    # which sets _wake; none can run between this check and wait().
                    self._wake.clear()
                    self.new_token_ratio = self.init_new_token_ratio
                    self._idle.set()
                    await self._wake.wait()
                    self._idle.clear()
            else:
                await asyncio.sleep(0)  # let HTTP handlers run between rounds
        for _, fut in pending:
            fut.result()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _launch(self, batch: ScheduleBatch) -> tuple[ScheduleBatch, Future[BatchResult]]:
        mwb = batch.get_model_worker_batch(self.futures)
        launch = getattr(self.runner, "launch", None)  # ModelRunner.launch; bench stubs only forward
        fut = launch(self.executor, mwb) if launch else self.executor.submit(self.runner.forward_batch_generation, mwb)
        return batch.copy_for_result(), fut

    # ---- building batches ------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.chunked_req is not None:
            if self.chunked_req.to_abort:
                self._finish_aborted_chunked_req()
            else:
                self.tree_cache.cache_unfinished_req(self.chunked_req)

        last = self.last_batch
        # With overlap `last` is still running; requests it brings to max_new_tokens
        # end there, so the next batch leaves them out rather than run one step past.
        ends = self.inflight > 0 and last is not None
        if ends and last.forward_mode.is_decode():  # type: ignore[union-attr]
            self.running_batch.drop_reqs_ending_in_flight()
        if last is not None and last.forward_mode.is_extend():
            # Prompts enter the tree as soon as their prefill is scheduled, so the
            # next batch already shares them (the worker runs forwards in order).
            for r in last.reqs[: last.batch_size() - len(last.decoding_reqs)]:
                if r.req_pool_idx is not None and not r.finished() and r is not self.chunked_req:
                    r.row_dirty |= self.tree_cache.cache_unfinished_req(r)
            keep = [i for i, r in enumerate(last.reqs) if not r.finished() and r is not self.chunked_req and r.req_pool_idx is not None]
            last.filter_batch(keep)
            if ends:
                last.drop_reqs_ending_in_flight()
            if not last.is_empty():
                if self.running_batch.is_empty():
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)
                self.running_batch.forward_mode = ForwardMode.DECODE
            self.last_batch = None

        # Between two chunks of a long prompt, running requests get a decode round
        # (unless they ride along in mixed batches): streams keep flowing.
        chunk_waits = (
            self.chunked_req is not None
            and last is not None
            and last.forward_mode.is_extend()
            and not self.settings.enable_mixed_chunk
            and not self.running_batch.is_empty()
        )
        if not chunk_waits:
            new_batch = self.get_new_batch_prefill()
            if new_batch is not None:
                return new_batch
        return self.update_running_batch()

    def _finish_aborted_chunked_req(self) -> None:
        req = self.chunked_req
        assert req is not None
        self.chunked_req = None
        req.finished_reason = FinishReason("abort", message="aborted")
        self.tree_cache.cache_finished_req(req, kv_len=len(req.fill_ids))
        self._on_finished(req)
        self.output.emit(req)

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        running = self.running_batch
        if (running.batch_is_full or not self.waiting_queue) and self.chunked_req is None:
            return None
        running_bs = running.batch_size()
        room = min(self.max_running_requests - running_bs, self.req_to_token_pool.available_size())
        if room <= 0 and self.chunked_req is None:
            running.batch_is_full = True
            return None

        prefix_done = self.policy.calc_priority(self.waiting_queue)
        mixed = self.settings.enable_mixed_chunk and running_bs > 0
        if mixed and self.chunked_prefill_size is not None and self.chunked_prefill_size - running_bs < self.page_size:
            mixed = False  # leave the chunked request room to progress
        adder = PrefillAdder(
            self.page_size,
            self.tree_cache,
            self.allocator,
            running,
            self.new_token_ratio,
            self.settings.max_prefill_tokens,
            self.chunked_prefill_size,
            running_bs if mixed else 0,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()
            self.chunked_req = adder.add_chunked_req(self.chunked_req)

        for req in self.waiting_queue:
            if running_bs + len(adder.can_run_list) >= self.max_running_requests or len(adder.can_run_list) >= room:
                running.batch_is_full = True
                break
            if not prefix_done:
                req.init_next_round_input(self.tree_cache)
            result = adder.add_req(req)
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    running.batch_is_full = True
                break

        can_run = adder.can_run_list
        if not can_run:
            return None
        admitted = {id(r) for r in can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        for r in self.waiting_queue:
            if prefix_done or r.last_node is not None:
                self._release_waiting(r)
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:
            self.chunked_req.is_chunked += 1
            self.stats.add("num_chunked_prefills")
        for r in can_run:
            if r.first_scheduled_time is None:  # first prefill (not a later chunk or a re-prefill)
                r.cached_tokens = len(r.prefix_indices)

        batch = ScheduleBatch(can_run, self.req_to_token_pool, self.allocator, self.tree_cache, chunked_req=self.chunked_req)
        batch.prepare_for_extend()
        self.stats.log_prefill(self, len(can_run), adder.log_input_tokens, adder.log_hit_tokens, running_bs)
        if mixed:
            self.running_batch.filter_batch([i for i, r in enumerate(running.reqs) if not r.finished()])
            if not self.running_batch.is_empty() and self.running_batch.check_decode_mem():
                batch.mix_with_running(self.running_batch)
                self.running_batch = self._empty_batch()
                self.stats.add("num_mixed_batches")
        return batch

    def update_running_batch(self) -> ScheduleBatch | None:
        batch = self.running_batch
        batch.filter_batch([i for i, r in enumerate(batch.reqs) if not r.finished()])
        if batch.is_empty():
            batch.batch_is_full = False
            return None
        if not batch.check_decode_mem():
            self.retract_decode(batch)
            self.new_token_ratio = self.init_new_token_ratio
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.is_empty():
            return None
        batch.prepare_for_decode()
        self.stats.on_decode_step(self)
        return batch

    def retract_decode(self, batch: ScheduleBatch) -> None:
        """Send requests back to the front of the waiting queue until the rest can decode."""
        retracted = batch.retract_decode()
        self.waiting_queue[:0] = retracted
        self.stats.add("num_retracted_reqs_total", len(retracted))
        log.info("Retract requests.", retracted=len(retracted), running=batch.batch_size(), new_token_ratio=self.new_token_ratio)

    # ---- results ------------------------------------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        token_pos = num_tokens = 0
        n_extend = batch.batch_size() - len(batch.decoding_reqs) if batch.forward_mode.is_extend() else 0
        output = self.output
        for i, req in enumerate(batch.reqs):
            token_pos += batch.extend_lens[i]
            if req.epoch != batch.epochs[i]:
                continue  # retracted after this forward was launched
            if i < n_extend:
                if req.is_chunked > 0:
                    req.is_chunked -= 1
                    continue
                req.has_prefilled = True
            if req.finished():
                # Overlap ran one step past the finish: return that step's KV slot
                # unless it shares the (already released) tail page.
                if (batch.seq_lens[i] - 1) % self.page_size == 0:
                    self.allocator.free(batch.out_cache_loc[token_pos - 1 : token_pos])  # type: ignore[index]
                continue
            if req.to_abort:
                req.finished_reason = FinishReason("abort", message="aborted")
            elif req.sampling_params.max_new_tokens == 0:
                req.finished_reason = FinishReason("length", 0)
            else:
                num_tokens += 1
                req.output_ids.append(result.next_token_ids[i])
                if req.return_logprob:
                    result.append_logprobs(req, i)
                req.check_finished()
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            output.step(req)  # detokenize; may finish the request on a stop string
            if req.finished():
                # This forward wrote KV for positions < seq_len; later ones have none.
                self.tree_cache.cache_finished_req(req, kv_len=batch.seq_lens[i])
                self._on_finished(req)
            output.emit(req)
        self.stats.add("generation_tokens_total", num_tokens)

    def _on_finished(self, req: Req) -> None:
        self.reqs_by_rid.pop(req.rid, None)
        self.stats.on_finished(req)

    def token_usage(self) -> float:
        return self.stats.token_usage(self)
