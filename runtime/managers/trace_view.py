"""What the engine's callers read of request traces, and the OTLP hook-up.

Read without locking, as `get_server_info` is: the running requests' dict and the
TraceStore are written only on the scheduler's loop, each read here copies a whole
entry at once (atomic under the GIL), and a trace's own records are copied before use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.managers.io_struct import TraceJSON, TraceSummaryJSON

if TYPE_CHECKING:
    from runtime.managers.scheduler import Scheduler
    from runtime.managers.trace_otlp import OtlpTraceExporter


def trace_of(scheduler: Scheduler, rid: str) -> TraceJSON | None:
    """The timeline of a running request or one of the last finished ones; None if unknown."""
    req = scheduler.reqs_by_rid.get(rid)
    if req is not None:
        return req.trace.to_json(len(req.output_ids))
    done = scheduler.traces.get(rid)
    return None if done is None else done.to_json()


def recent(scheduler: Scheduler, limit: int) -> list[TraceSummaryJSON]:
    """Every running request (newest first), then the finished ones, newest first: `limit` at most."""
    running = sorted(list(scheduler.reqs_by_rid.values()), key=lambda r: r.trace.arrival, reverse=True)
    out = [r.trace.summary(len(r.output_ids)) for r in running[:limit]]
    return out + [t.summary() for t in scheduler.traces.recent(max(limit - len(out), 0))]


def export_to(scheduler: Scheduler, endpoint: str | None) -> OtlpTraceExporter | None:
    """Export every finished trace to the OTLP/HTTP `endpoint` (the SDK is imported only then)."""
    if not endpoint:
        return None
    from runtime.managers.trace_otlp import OtlpTraceExporter

    exporter = OtlpTraceExporter.to_endpoint(endpoint)
    scheduler.traces.exporter = exporter
    return exporter
