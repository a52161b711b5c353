"""Scheduler counters, the SGLang-style log lines, and the server-info snapshot.

The stats never see the Scheduler: it hands them a `LoadSnapshot` of its queues
and pools each time they log or report.
"""

from __future__ import annotations

import collections
import collections.abc
import time
from dataclasses import asdict, dataclass
from typing import Any

import structlog

from runtime.managers.disagg_hooks import DisaggQueues
from runtime.managers.req import Req

log = structlog.get_logger("sluice.scheduler")


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    max_total_num_tokens: int
    available_kv_tokens: int
    evictable_kv_tokens: int
    tree_cache_tokens: int  # every slot the prefix cache holds (evictable or locked)
    num_running_reqs: int
    num_waiting_reqs: int
    req_pool_free_rows: int
    req_pool_size: int
    max_running_requests: int
    context_len: int
    disagg: DisaggQueues | None = None  # prefill/decode servers only

    @property
    def token_usage(self) -> float:
        """Share of the KV pool held by requests (cached-but-evictable tokens count as free)."""
        used = self.max_total_num_tokens - self.available_kv_tokens - self.evictable_kv_tokens
        return used / self.max_total_num_tokens


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

    def log_prefill(self, s: LoadSnapshot, new_seq: int, new_tokens: int, cached_tokens: int, running_bs: int) -> None:
        self.counters["prefill_tokens_total"] += new_tokens
        log.info(
            f"Prefill batch. #new-seq: {new_seq}, #new-token: {new_tokens}, #cached-token: {cached_tokens}, "
            f"token usage: {s.token_usage:.2f}, #running-req: {running_bs}, #queue-req: {s.num_waiting_reqs}"
            + _disagg_fields(s.disagg)
        )

    def on_decode_step(self, snapshot: collections.abc.Callable[[], LoadSnapshot]) -> None:
        """Count a decode step; every `decode_log_interval` steps, log the line SGLang logs."""
        self.decode_steps += 1
        if self.decode_steps % self.decode_log_interval:
            return
        s = snapshot()
        now, gen = time.monotonic(), self.counters["generation_tokens_total"]
        self.gen_throughput = (gen - self._last_log_tokens) / max(now - self._last_log_time, 1e-6)
        self._last_log_time, self._last_log_tokens = now, gen
        log.info(
            f"Decode batch. #running-req: {s.num_running_reqs}, "
            f"#token: {s.max_total_num_tokens - s.available_kv_tokens}, "
            f"token usage: {s.token_usage:.2f}, gen throughput (token/s): {self.gen_throughput:.2f}, "
            f"#queue-req: {s.num_waiting_reqs}" + _disagg_fields(s.disagg)
        )

    def server_info(self, s: LoadSnapshot) -> dict[str, Any]:
        c = self.counters
        q = s.disagg or DisaggQueues()
        return {
            **{k: v for k, v in asdict(s).items() if k != "disagg"},
            "num_prefill_bootstrap_queue_reqs": q.bootstrap,
            "num_decode_prealloc_queue_reqs": q.prealloc,
            "num_prefill_inflight_queue_reqs": q.inflight,
            "num_decode_transfer_queue_reqs": q.transfer,
            "token_usage": s.token_usage,
            "cache_hit_rate": c["cached_tokens_total"] / max(c["prompt_tokens_total"], 1),
            "gen_throughput": self.gen_throughput,
            "num_retracted_reqs_total": c["num_retracted_reqs_total"],
            "num_preempted_reqs_total": c["num_preempted_reqs_total"],  # retracted for a higher priority
            "num_requests_total": c["num_requests_total"],
            "prompt_tokens_total": c["prompt_tokens_total"],
            "generation_tokens_total": c["generation_tokens_total"],
            "prefill_tokens_total": c["prefill_tokens_total"],  # prompt tokens computed (cache hits excluded)
            "cached_tokens_total": c["cached_tokens_total"],
            "num_aborted_requests_total": c["num_aborted_requests_total"],
        }


def _disagg_fields(q: DisaggQueues | None) -> str:
    if q is None:
        return ""
    if q.mode == "decode":
        return f", #prealloc-queue-req: {q.prealloc}, #transfer-queue-req: {q.transfer}"
    return f", #bootstrap-queue-req: {q.bootstrap}, #inflight-queue-req: {q.inflight}"
