"""Scheduler: owns the running batch, builds each round's batch, and ends every request.

SchedulerLoop (scheduler_loop.py) drives it: get_next_batch_to_run() -> launch ->
process_batch_result(), overlapped. The waiting queue and the chunked request live
in the PrefillManager, the running batch in the DecodeManager; a forward's result
reaches its requests through the ResultProcessor.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from config.settings import EngineSettings
from runtime.managers.decode_manager import DecodeManager
from runtime.managers.embedding_manager import EmbeddingManager
from runtime.managers.disagg_hooks import Disaggregation
from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.prefill_manager import PrefillManager
from runtime.managers.req import FinishReason, Req, aborted
from runtime.managers.result_processor import ResultProcessor
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.scheduler_output import OutputProcessor
from runtime.managers.scheduler_stats import LoadSnapshot, SchedulerStats
from runtime.managers.trace import TraceStore
from runtime.mem.pools import MemoryPools
from runtime.model_executor.future_map import FutureMap
from runtime.model_executor.pooler import EmbeddingResult
from runtime.model_executor.worker import BatchResult, Worker

log = structlog.get_logger("sluice.scheduler")


class Scheduler:
    def __init__(self, settings: EngineSettings, pools: MemoryPools, worker: Worker, output: OutputProcessor) -> None:
        self.settings = settings
        self.pools = pools
        self.req_to_token_pool = pools.req_to_token_pool
        self.allocator = pools.allocator
        self.tree_cache = pools.tree_cache
        self.max_total_num_tokens = pools.max_total_num_tokens
        self.max_running_requests = settings.max_running_requests or 1
        self.page_size = settings.page_size
        self.worker = worker
        self.output = output
        self.stats = SchedulerStats(settings.decode_log_interval)
        self.prefill = PrefillManager(settings, pools, self.stats)
        self.futures = FutureMap(capacity=4 * self.max_running_requests + 4 * (settings.max_prefill_tokens + 8), device=worker.device)
        worker.attach_future_map(self.futures)
        self.enable_overlap = not settings.disable_overlap_schedule

        self.decode = DecodeManager(settings, pools, self.stats)
        self.last_batch: ScheduleBatch | None = None
        self.reqs_by_rid: dict[str, Req] = {}
        self.traces = TraceStore(settings.trace_buffer_size)  # finished requests' timelines (trace.py)
        self.disagg: Disaggregation | None = None  # set by the engine in prefill/decode mode
        self.grammars: GrammarManager | None = None  # set by the engine with --grammar-backend xgrammar
        self.embeddings = EmbeddingManager(settings.pooling, self.finish) if settings.is_embedding else None
        self.results = ResultProcessor(self.allocator, self.page_size, output, self.stats, self.finish)

        self._wake = asyncio.Event()
        self.inflight = 0  # forwards launched but not yet processed (SchedulerLoop sets it)

    @property
    def running_batch(self) -> ScheduleBatch:
        return self.decode.running_batch

    @property
    def waiting_queue(self) -> list[Req]:
        return self.prefill.waiting_queue

    @property
    def chunked_req(self) -> Req | None:
        return self.prefill.chunked_req

    # ---- requests in/out --------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.reqs_by_rid[req.rid] = req
        if self.grammars is None or not self.grammars.add(req):
            self._enqueue(req)
        else:
            req.trace.queued("grammar")
        self._wake.set()

    def _enqueue(self, req: Req) -> None:
        """A request ready to schedule (its grammar, if any, compiled)."""
        if self.disagg is None or not self.disagg.add(req):
            req.trace.queued("waiting")
            self.waiting_queue.append(req)

    def wake(self) -> None:
        self._wake.set()

    def abort(self, rid: str | None = None, reason: FinishReason | None = None) -> None:
        """Abort one request (or all with rid=None). Waiting ones end now; running
        ones end at their next result, which frees their KV. `reason`: why, when the
        server (not the client) ends it."""
        targets = list(self.reqs_by_rid.values()) if rid is None else [self.reqs_by_rid.get(rid)]
        for req in targets:
            if req is None or req.finished():
                continue
            req.to_abort, req.abort_reason = True, reason
            if self.disagg is not None and self.disagg.abort(req):
                continue
            if self.grammars is not None and self.grammars.abort(req):
                continue
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
                self.finish(req, req.abort_reason or aborted())
        self._wake.set()

    def finish(self, req: Req, reason: FinishReason, kv_len: int = 0) -> None:
        """The one place a request ends: set its reason, release its memory, count
        it, and send its last output.

        A request holding a row donates the KV of its first `kv_len` tokens (what
        its last forward computed) to the prefix cache and gives the row back; a
        waiting one only drops its unlocked prefix match."""
        assert not req.finished(), f"{req.rid} finished twice"
        req.finished_reason = reason
        req.trace.finished(reason.type, reason.message, len(req.output_ids), kv_len)
        if self.disagg is not None and self.disagg.hold(req, kv_len):
            return  # a prefill server's KV is on its way: release_held ends it
        self._release(req, kv_len)

    def release_held(self, req: Req, kv_len: int, error: FinishReason | None) -> None:
        """The KV transfer of a held request ended: acknowledged, or failed with `error`."""
        if error is not None:
            req.finished_reason = error
        self._release(req, kv_len)
        self._wake.set()

    def _release(self, req: Req, kv_len: int) -> None:
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req, kv_len=kv_len)
        else:
            PrefillManager.release_waiting(req)
        self.traces.put(req.trace)  # before it leaves reqs_by_rid: readers always find it
        self.reqs_by_rid.pop(req.rid, None)
        self.stats.on_finished(req)
        self.output.emit(req)
        self.traces.export(req.trace)  # after the last output: OTLP never delays it

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

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(
            disagg=self.disagg.queues() if self.disagg is not None else None,
            max_total_num_tokens=self.max_total_num_tokens,
            available_kv_tokens=self.allocator.available_size(),
            evictable_kv_tokens=self.tree_cache.evictable_size(),
            tree_cache_tokens=self.tree_cache.total_size(),
            num_running_reqs=self.num_running_reqs,
            num_waiting_reqs=len(self.waiting_queue),
            req_pool_free_rows=self.req_to_token_pool.available_size(),
            req_pool_size=self.req_to_token_pool.size,
            max_running_requests=self.max_running_requests,
            context_len=self.req_to_token_pool.context_len,
        )

    def server_info(self) -> dict[str, Any]:
        info = self.stats.server_info(self.snapshot())
        return info if self.disagg is None else {**info, **self.disagg.info()}

    # ---- for the loop (scheduler_loop.py) ------------------------------------------------
    def has_work(self) -> bool:
        # (The disaggregation queues move only on events, which wake the loop.)
        return bool(self.waiting_queue) or not self.running_batch.is_empty() or self.chunked_req is not None

    def begin_round(self) -> None:
        """From here on, an add_request, abort, wake or stop (each sets _wake) means the
        round must look again: a wake during the round's awaits is not lost."""
        self._wake.clear()

    async def sleep_until_woken(self) -> None:
        """Called with nothing to do since begin_round: returns at once if something
        woke the scheduler meanwhile (a KV transfer, a grammar, a request)."""
        self.decode.new_token_ratio = self.decode.init_new_token_ratio
        await self._wake.wait()

    def fail_all(self, exc: Exception) -> None:
        """A round raised: every request ends with the error and the pools start over."""
        reqs = list(self.reqs_by_rid.values())
        if self.grammars is not None:
            self.grammars.queue.clear()  # they hold nothing
        for req in reqs if self.disagg is not None else ():
            self.disagg.abort(req)  # reservations and transfers end while the pools are intact
        self.prefill.waiting_queue, self.prefill.chunked_req = [], None
        self.decode.running_batch, self.last_batch = self.decode.empty_batch(), None
        self.req_to_token_pool.clear()
        self.allocator.clear()
        self.tree_cache.reset()
        self.inflight = 0
        for req in reqs:  # the pools were reset wholesale: nothing left to release
            req.req_pool_idx = None
            if not req.finished():  # (a held one ends when its transfer does)
                self.finish(req, aborted(f"internal error: {exc}"))

    # ---- building batches ------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        prebuilt: list[Req] = []
        if self.grammars is not None:
            for req in self.grammars.move_ready():
                self._enqueue(req)
        if self.disagg is not None:
            bootstrapped, prebuilt = self.disagg.poll()
            self.waiting_queue.extend(bootstrapped)
        chunked = self.chunked_req
        if chunked is not None:
            if chunked.to_abort:
                self.prefill.chunked_req = None
                self.finish(chunked, chunked.abort_reason or aborted(), kv_len=len(chunked.fill_ids))
            else:
                self.tree_cache.cache_unfinished_req(chunked)

        last = self.last_batch
        # Read before merging: merge_prefilled may adopt `last` as the running batch
        # and turn its mode to DECODE.
        last_was_extend = last is not None and last.forward_mode.is_extend()
        # With overlap `last` is still running; requests it brings to max_new_tokens
        # end there, so the next batch leaves them out rather than run one step past.
        ends = self.inflight > 0 and last is not None
        if ends and last is not None and last.forward_mode.is_decode():
            self.running_batch.drop_reqs_ending_in_flight()
        if last is not None and last_was_extend:
            self.decode.merge_prefilled(last, ends, self.chunked_req)
            self.last_batch = None
        if prebuilt:  # after the in-flight filtering above: these are not in flight
            self.admit_prebuilt(prebuilt)

        # Between two chunks of a long prompt, running requests get a decode round
        # (unless they ride along in mixed batches): streams keep flowing.
        chunk_waits = (
            self.chunked_req is not None
            and last_was_extend
            and not self.settings.enable_mixed_chunk
            and not self.running_batch.is_empty()
        )
        if not chunk_waits:
            new_batch = self._get_new_batch_prefill()
            if new_batch is not None:
                return new_batch
        batch, retracted = self.decode.update_running_batch(self.snapshot)
        self.waiting_queue[:0] = retracted
        return batch

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        new = self.prefill.get_new_batch_prefill(self.running_batch, self.decode.new_token_ratio, self.max_running_requests, self.snapshot)
        if new is not None and new.mix_running:
            self.decode.mix_into(new.batch)
        return None if new is None else new.batch

    def admit_prebuilt(self, reqs: list[Req]) -> None:
        """Decode server: requests whose prompt KV and first token came from a prefill
        server emit that token, then (unless it ended them) join the running batch."""
        joining = self.results.process_prebuilt(reqs)
        if joining:
            self.decode.join_prebuilt(joining)

    # ---- results (result_processor.py) ------------------------------------------------
    def process_batch_result(self, batch: ScheduleBatch, result: BatchResult) -> None:
        if self.embeddings is not None and isinstance(result, EmbeddingResult):
            return self.embeddings.process(batch, result)  # an embedding server samples nothing
        self.results.process_batch_result(batch, result)
