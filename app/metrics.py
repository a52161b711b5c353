"""Prometheus metrics under SGLang's names (plus vLLM's gateway gauges).

Gauges and counters are read from `engine.get_server_info()` at scrape time by
`EngineCollector`, so they cannot drift from the engine. Latency histograms are
observed by the app per request (`RequestTimer`). Everything lives in the app's own
`CollectorRegistry`, never the process-global one, and carries `model_name`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runtime.managers.io_struct import GenerateOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (exposed name, get_server_info key, help)
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("sglang:num_running_reqs", "num_running_reqs", "Requests in the running batch."),
    ("sglang:num_queue_reqs", "num_waiting_reqs", "Requests in the waiting queue."),
    ("sglang:token_usage", "token_usage", "Fraction of KV slots in use."),
    ("sglang:cache_hit_rate", "cache_hit_rate", "Prefix cache hit rate."),
    ("sglang:gen_throughput", "gen_throughput", "Generation throughput (tokens/s)."),
    ("sglang:num_retracted_reqs", "num_retracted_reqs_total", "Requests retracted for lack of KV (cumulative)."),
    ("vllm:num_requests_running", "num_running_reqs", "Requests running (vLLM name)."),
    ("vllm:num_requests_waiting", "num_waiting_reqs", "Requests waiting (vLLM name)."),
    ("vllm:kv_cache_usage_perc", "token_usage", "KV cache usage, 0..1 (vLLM name)."),
    # Prefill/decode disaggregation (0 on a plain server).
    ("sglang:num_prefill_bootstrap_queue_reqs", "num_prefill_bootstrap_queue_reqs", "Prefill: requests waiting for their decode peer."),
    ("sglang:num_prefill_inflight_queue_reqs", "num_prefill_inflight_queue_reqs", "Prefill: requests whose KV is being sent."),
    ("sglang:num_decode_prealloc_queue_reqs", "num_decode_prealloc_queue_reqs", "Decode: requests waiting for KV slots."),
    ("sglang:num_decode_transfer_queue_reqs", "num_decode_transfer_queue_reqs", "Decode: requests waiting for their KV."),
    ("sglang:kv_transfer_latency_seconds", "kv_transfer_latency_seconds", "Smoothed latency of one request's KV transfer."),
)
# Exposed with exactly these names; CounterMetricFamily strips and re-adds `_total`.
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("sglang:prompt_tokens_total", "prompt_tokens_total", "Prompt tokens processed."),
    ("sglang:generation_tokens_total", "generation_tokens_total", "Tokens generated."),
    ("sglang:cached_tokens_total", "cached_tokens_total", "Prompt tokens served from the prefix cache."),
    ("sglang:num_requests_total", "num_requests_total", "Requests finished."),
    ("sglang:num_aborted_requests_total", "num_aborted_requests_total", "Requests aborted."),
    ("sluice:num_preempted_reqs_total", "num_preempted_reqs_total", "Running requests preempted for higher-priority ones."),
    ("sglang:kv_transfer_bytes_total", "kv_transfer_bytes_total", "KV bytes sent (prefill) or received (decode)."),
    ("sglang:kv_transfers_total", "kv_transfers_total", "Requests whose KV transfer completed."),
    ("sglang:kv_transfer_failures_total", "kv_transfer_failures_total", "Requests whose KV transfer failed."),
    ("sglang:kv_transfer_seconds_total", "kv_transfer_seconds_total", "Time spent in completed KV transfers."),
)

TTFT_BUCKETS = (0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
               0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)


class EngineCollector(Collector):
    """Reads the engine's counters at scrape time; yields nothing until it has loaded."""

    def __init__(self, server_info: Callable[[], dict[str, Any] | None], model_name: Callable[[], str]) -> None:
        self._server_info = server_info
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        info = self._server_info()
        if info is None:
            return
        labels = [self._model_name()]
        for name, key, help_text in GAUGES:
            gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
            gauge.add_metric(labels, float(info.get(key) or 0))
            yield gauge
        for name, key, help_text in COUNTERS:
            counter = CounterMetricFamily(name, help_text, labels=["model_name"])
            counter.add_metric(labels, float(info.get(key) or 0))
            yield counter


class LatencyWindow:
    """The observations of the last `seconds` (perf_counter clock), for the dashboard's
    percentiles; at most `max_items` are kept (the oldest go first)."""

    __slots__ = ("seconds", "_items")

    def __init__(self, seconds: float = 60.0, max_items: int = 100_000) -> None:
        self.seconds = seconds
        self._items: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_items)

    def observe(self, value: float, now: float) -> None:
        self._items.append((now, value))

    def percentiles(self, now: float) -> dict[str, float | None]:
        """count, p50, p90, p99 (nearest rank) of the window ending at `now`; None when empty."""
        while self._items and self._items[0][0] < now - self.seconds:
            self._items.popleft()
        values = sorted(v for _, v in self._items)
        out: dict[str, float | None] = {"count": float(len(values))}
        for q in (50, 90, 99):
            out[f"p{q}"] = values[min(len(values) - 1, (q * len(values) + 99) // 100 - 1)] if values else None
        return out


class Metrics:
    def __init__(self, server_info: Callable[[], dict[str, Any] | None], model_name: Callable[[], str]) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series, as in SGLang
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(server_info, model_name))
        self._model_name = model_name
        kw: dict[str, Any] = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Arrival to first output text.", buckets=TTFT_BUCKETS, **kw)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Gap between output chunks.", buckets=ITL_BUCKETS, **kw)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Arrival to last output.", buckets=E2E_BUCKETS, **kw)
        self.queue = Histogram("sglang:queue_time_seconds", "Time in the waiting queue.", buckets=E2E_BUCKETS, **kw)
        self.recent_ttft = LatencyWindow()  # the dashboard's last minute
        self.recent_itl = LatencyWindow()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float) -> RequestTimer:
        name = self._model_name()
        return RequestTimer(self, name, arrival)


class RequestTimer:
    """Latency bookkeeping of one engine request, from HTTP arrival to its last chunk."""

    __slots__ = ("_metrics", "_name", "_arrival", "_last", "_done", "_itl")

    def __init__(self, metrics: Metrics, name: str, arrival: float) -> None:
        self._metrics = metrics
        self._name = name
        self._arrival = arrival
        self._last: float | None = None  # time of the last chunk that carried text
        self._done = False
        self._itl = metrics.itl.labels(name)  # once, not per token

    def on_chunk(self, chunk: GenerateOutput) -> None:
        now = time.perf_counter()
        if chunk["text"]:
            if self._last is None:
                self._metrics.ttft.labels(self._name).observe(now - self._arrival)
                self._metrics.recent_ttft.observe(now - self._arrival, now)
            else:  # a chunk of k tokens (--stream-interval): k gaps of 1/k its wait, as SGLang counts them
                k = max(1, len(chunk["output_ids"]))
                gap = (now - self._last) / k
                for _ in range(k):
                    self._itl.observe(gap)
                    self._metrics.recent_itl.observe(gap, now)
            self._last = now
        meta = chunk["meta_info"]
        if meta["finish_reason"] is not None and not self._done:
            self._done = True
            self._metrics.e2e.labels(self._name).observe(now - self._arrival)
            if meta["queue_time"] >= 0:
                self._metrics.queue.labels(self._name).observe(meta["queue_time"])
