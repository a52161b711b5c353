"""Finished request traces as OpenTelemetry spans (`--otlp-traces-endpoint`, vLLM's flag).

One span per request (`sluice.request`, kind SERVER), whose parent is the caller's
W3C trace context when its HTTP request carried a `traceparent`; one child span per
phase of the trace (tokenize, queue, prefill, decode, kv_transfer) with the trace's
own start and end times. Prefill chunks are events of their prefill span; first
token, retractions, abort requests and the finish are events of the request span.

Spans are built on the scheduler's loop right after a request's last output (about
150 us for a request's five spans on this project's CPU: inline, it costs a bounded,
predictable slice of one round, where a builder thread would contend for the GIL in
5 ms switch intervals) and exported off it, in batches, by the SDK's
BatchSpanProcessor thread; the OTLP exporter posts protobuf over HTTP.
"""

from __future__ import annotations

from opentelemetry import trace as otel
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from runtime.managers.trace import MONO_TO_UNIX, Fields, RequestTrace, phases

SERVICE_NAME = "sluice"


def _ns(mono: float) -> int:
    return int((mono + MONO_TO_UNIX) * 1e9)


def _attributes(fields: Fields | None, prefix: str = "sluice.") -> dict[str, AttributeValue]:
    """OTel attributes take no None: unset fields are left out."""
    return {prefix + k: v for k, v in (fields or {}).items() if v is not None}


class OtlpTraceExporter:
    """Called with each finished trace (TraceStore.exporter)."""

    def __init__(self, exporter: SpanExporter, service_name: str = SERVICE_NAME) -> None:
        # A provider of our own: the process-wide one (set by an embedding application) is left alone.
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("sluice.scheduler")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def to_endpoint(cls, endpoint: str) -> OtlpTraceExporter:
        """Export to an OTLP/HTTP collector, e.g. http://localhost:4318/v1/traces."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint))

    def __call__(self, trace: RequestTrace) -> None:
        records = list(trace.events)
        spans, instants = phases(records)
        end = max(t for _, t, _ in records)
        parent = self.propagator.extract(dict(trace.options.headers)) if trace.options.headers else None
        summary = trace.summary()
        root = self.tracer.start_span(
            "sluice.request", context=parent, kind=otel.SpanKind.SERVER, start_time=_ns(records[0][1]),
            attributes=_attributes({
                "rid": trace.rid, "prompt_tokens": summary["prompt_tokens"], "output_tokens": summary["output_tokens"],
                "cached_tokens": summary["cached_tokens"], "retractions": summary["retractions"],
                "finish_reason": summary["finish_reason"],
            }),
        )
        if trace.finish_reason == "abort":
            root.set_status(otel.Status(otel.StatusCode.ERROR, "aborted"))
        context = otel.set_span_in_context(root)
        for span in spans:
            child = self.tracer.start_span(span.name, context=context, start_time=_ns(span.start),
                                           attributes=_attributes(span.attributes))
            for name, t, fields in span.events:
                child.add_event(name, _attributes(fields), _ns(t))
            child.end(_ns(span.end if span.end is not None else end))
        for name, t, fields in instants:
            root.add_event(name, _attributes(fields), _ns(t))
        root.end(_ns(end))

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is queued, then stop the exporting thread."""
        self.provider.shutdown()
