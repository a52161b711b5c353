"""Scheduler counters, the SGLang-style log lines, and the server-info snapshot."""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from runtime.req import Req
    from runtime.scheduler import Scheduler

log = structlog.get_logger("sluice.scheduler")


class SchedulerStats:
    def __init__(self, decode_log_interval: int) -> None:
        self.counters: collections.Counter[str] = collections.Counter()
        self.decode_log_interval = decode_log_interval
        self.decode_steps = 0
        self.gen_throughput = 0.0
        self._last_log_time = time.monotonic()
        self._last_log_tokens = 0

    def __getitem__(self, key: str) -> int:
        return self.counters[key]

    def add(self, key: str, n: int = 1) -> None:
        self.counters[key] += n

    def on_finished(self, req: Req) -> None:
        c = self.counters
        c["num_requests_total"] += 1
        c["prompt_tokens_total"] += len(req.origin_input_ids)
        c["cached_tokens_total"] += req.cached_tokens
        if req.finished_reason is not None and req.finished_reason.type == "abort":
            c["num_aborted_requests_total"] += 1

    @staticmethod
    def token_usage(s: Scheduler) -> float:
        used = s.max_total_num_tokens - s.allocator.available_size() - s.tree_cache.evictable_size()
        return used / s.max_total_num_tokens

    def log_prefill(self, s: Scheduler, new_seq: int, new_tokens: int, cached_tokens: int, running_bs: int) -> None:
        log.info(
            f"Prefill batch. #new-seq: {new_seq}, #new-token: {new_tokens}, #cached-token: {cached_tokens}, "
            f"token usage: {self.token_usage(s):.2f}, #running-req: {running_bs}, #queue-req: {len(s.waiting_queue)}"
        )

    def on_decode_step(self, s: Scheduler) -> None:
        self.decode_steps += 1
        if self.decode_steps % self.decode_log_interval:
            return
        now, gen = time.monotonic(), self.counters["generation_tokens_total"]
        self.gen_throughput = (gen - self._last_log_tokens) / max(now - self._last_log_time, 1e-6)
        self._last_log_time, self._last_log_tokens = now, gen
        log.info(
            f"Decode batch. #running-req: {s.running_batch.batch_size()}, "
            f"#token: {s.max_total_num_tokens - s.allocator.available_size()}, "
            f"token usage: {self.token_usage(s):.2f}, gen throughput (token/s): {self.gen_throughput:.2f}, "
            f"#queue-req: {len(s.waiting_queue)}"
        )

    def server_info(self, s: Scheduler) -> dict[str, Any]:
        c = self.counters
        return {
            "max_total_num_tokens": s.max_total_num_tokens,
            "available_kv_tokens": s.allocator.available_size(),
            "evictable_kv_tokens": s.tree_cache.evictable_size(),
            "num_running_reqs": s.num_running_reqs,
            "num_waiting_reqs": len(s.waiting_queue),
            "token_usage": self.token_usage(s),
            "cache_hit_rate": c["cached_tokens_total"] / max(c["prompt_tokens_total"], 1),
            "gen_throughput": self.gen_throughput,
            "num_retracted_reqs_total": c["num_retracted_reqs_total"],
            "num_requests_total": c["num_requests_total"],
            "prompt_tokens_total": c["prompt_tokens_total"],
            "generation_tokens_total": c["generation_tokens_total"],
            "cached_tokens_total": c["cached_tokens_total"],
            "num_aborted_requests_total": c["num_aborted_requests_total"],
            "req_pool_free_rows": s.req_to_token_pool.available_size(),
            "req_pool_size": s.req_to_token_pool.size,
            "max_running_requests": s.max_running_requests,
            "context_len": s.req_to_token_pool.context_len,
        }
