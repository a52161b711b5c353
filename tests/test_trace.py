"""Per-request traces on the stub worker (issue #15): what the timeline records for a
plain request, a cached prefix, a chunked prompt, a retraction, an abort and a closed
stream; running requests and the ring buffer of finished ones; and the OpenTelemetry
export, through the SDK's in-memory exporter and through a real OTLP/HTTP post."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from runtime.engine import Engine
from runtime.managers.trace import TraceOptions, TraceStore, RequestTrace
from runtime.managers.trace_otlp import OtlpTraceExporter
from runtime.model_executor.worker import ModelWorkerBatch
from tests.stub_engine import generate_all, greedy, make_prompts, on_launch, pause_when, running_in, submit
from tests.test_scheduler_retract import LENGTHS, MAX_NEW, TIGHT
from test_pd_stub import PD, make_pd  # noqa: F401 - the fixture

Trace = Mapping[str, Any]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def names(trace: Trace) -> list[str]:
    return [e["event"] for e in trace["events"]]


def events(trace: Trace, name: str) -> list[dict[str, Any]]:
    return [e for e in trace["events"] if e["event"] == name]


def traced(engine: Engine, prompt: list[int], max_new: int) -> Trace:
    out = engine.generate(prompt, greedy(max_new), return_trace=True)
    assert isinstance(out, dict)
    trace: Trace = out["meta_info"]["trace"]
    return trace


def assert_well_formed(trace: Trace) -> None:
    times = [e["t"] for e in trace["events"]]
    assert times[0] == 0 and times == sorted(times), times
    spans = trace["spans"]
    for before, after in zip(spans, spans[1:]):
        assert before["end"] is not None and before["end"] <= after["start"] + 1e-9, (before, after)


def test_a_request_records_each_step_once_and_no_decode_step(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    prompt = make_prompts([20])[0]
    trace = traced(engine, prompt, 6)
    assert names(trace) == ["arrival", "tokenized", "queued", "prefill_chunk", "prefilled", "first_token", "finished"]
    assert_well_formed(trace)
    assert trace["state"] == "finished" and trace["finish_reason"] == "length"
    assert (trace["prompt_tokens"], trace["output_tokens"], trace["retractions"]) == (20, 6, 0)
    assert events(trace, "queued")[0]["queue"] == "waiting"
    (chunk,) = events(trace, "prefill_chunk")
    assert chunk["new_tokens"] == 20 and chunk["batch_size"] == 1 and chunk["more"] is False
    (finished,) = events(trace, "finished")
    assert finished["kv_slots"] == 20 + 6 - 1  # the last token's KV is never computed
    assert [s["name"] for s in trace["spans"]] == ["tokenize", "queue", "prefill", "decode"]
    assert trace["spans"][-1]["attributes"]["output_tokens"] == 6
    assert 0 < trace["ttft"] <= trace["e2e"]
    # What the buffer keeps is what the response carried.
    assert engine.get_trace(trace["rid"]) == trace


def test_a_cached_prefix_shows_its_radix_hit(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    first, other = make_prompts([40, 9], seed=3)
    traced(engine, first, 4)
    trace = traced(engine, first[:32] + other[1:], 4)
    (chunk,) = events(trace, "prefill_chunk")
    assert chunk["cache_hit"] == chunk["cached_tokens"] == trace["cached_tokens"] == 32
    assert chunk["new_tokens"] == 8 and chunk["kv_slots"] == 40 and chunk["readmitted"] is False


def test_a_chunked_prompt_records_every_chunk(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(chunked_prefill_size=16)
    trace = traced(engine, make_prompts([50])[0], 3)
    chunks = events(trace, "prefill_chunk")
    assert [c["new_tokens"] for c in chunks] == [16, 16, 16, 2]
    assert [c["cached_tokens"] for c in chunks] == [0, 16, 32, 48]
    assert [c["kv_slots"] for c in chunks] == [16, 32, 48, 50]
    assert [c["more"] for c in chunks] == [True, True, True, False]
    assert ["cache_hit" in c for c in chunks] == [True, False, False, False]  # one admission
    (prefill,) = [s for s in trace["spans"] if s["name"] == "prefill"]
    assert prefill["attributes"]["chunks"] == 4 and prefill["attributes"]["new_tokens"] == 50
    assert names(trace).count("prefilled") == 1
    assert_well_formed(trace)


def test_a_retraction_and_its_readmission_are_on_the_timeline(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**TIGHT)
    outs = generate_all(engine, make_prompts(LENGTHS, seed=5), greedy(MAX_NEW), return_trace=True)
    traces = [o["meta_info"]["trace"] for o in outs]
    retracted = [t for t in traces if t["retractions"]]
    assert retracted, "the tight pool retracted nothing"
    assert sum(t["retractions"] for t in traces) == engine.get_server_info()["num_retracted_reqs_total"]
    for trace in retracted:
        assert_well_formed(trace)
        assert trace["finish_reason"] == "length" and trace["output_tokens"] == MAX_NEW
        seq = names(trace)
        # (With overlap a request can be retracted before its prefill's result is in: that
        # prefill is dropped and has no prefilled record.)
        assert seq.count("retracted") == trace["retractions"] and 1 <= seq.count("prefilled") <= trace["retractions"] + 1
        for r in events(trace, "retracted"):
            assert 0 <= r["output_tokens"] < MAX_NEW and r["kv_slots"] >= trace["prompt_tokens"]
        # Each retraction is followed by a re-admission that says so.
        admissions = [e for e in events(trace, "prefill_chunk") if "cache_hit" in e]
        assert [a["readmitted"] for a in admissions] == [False] + [True] * trace["retractions"]
        requeued = [s for s in trace["spans"] if s["name"] == "queue" and s["attributes"].get("retracted")]
        assert len(requeued) == trace["retractions"]


async def test_an_abort_records_who_asked_and_what_the_request_held(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    prompt = make_prompts([16])[0]

    def abort_after_three_tokens(mwb: ModelWorkerBatch) -> bool:
        req = running_in(engine, "a", mwb)
        if req is None or len(req.output_ids) < 3:
            return False
        engine.abort("a")  # on the scheduler's loop, right after this launch
        return True

    on_launch(engine, abort_after_three_tokens)
    out = await engine.async_generate(prompt, greedy(200), rid="a", trace=TraceOptions(return_trace=True))
    trace = out["meta_info"]["trace"]
    assert trace["finish_reason"] == "abort"
    seq = names(trace)
    assert seq.index("abort_requested") < seq.index("finished") == len(seq) - 1
    assert events(trace, "abort_requested")[0]["why"] == "abort_request"
    (finished,) = events(trace, "finished")
    assert finished["reason"] == "abort" and finished["kv_slots"] >= 16 + 3 - 1
    assert finished["output_tokens"] == len(out["output_ids"])
    assert engine.get_trace("a") == trace


async def test_a_stream_closed_early_is_traced_as_such(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    stream = engine.async_generate_stream(make_prompts([8])[0], greedy(500), rid="s")
    async for _ in stream:
        break
    await stream.aclose()
    assert engine.wait_idle(timeout=30)
    trace = engine.get_trace("s")
    assert trace is not None and trace["finish_reason"] == "abort"
    assert [e["why"] for e in events(trace, "abort_requested")] == ["stream_closed"]


async def test_a_running_request_has_a_live_trace(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    # A later decode step: with overlap the first one is launched before the prefill's result is in.
    pause = pause_when(engine, lambda mwb: (r := running_in(engine, "live", mwb)) is not None and len(r.output_ids) >= 2)
    task = asyncio.ensure_future(submit(engine, "live", make_prompts([10])[0], greedy(8)))
    assert await asyncio.to_thread(pause.reached.wait, 30)
    trace = engine.get_trace("live")
    assert trace is not None and trace["state"] == "running" and trace["finish_reason"] is None
    assert trace["spans"][-1]["name"] == "decode" and trace["spans"][-1]["end"] is None
    assert [r["rid"] for r in engine.recent_traces(10)][0] == "live"
    pause.release.set()
    await task
    done = engine.get_trace("live")
    assert done is not None and done["state"] == "finished"
    assert engine.get_trace("no-such-request") is None


async def test_the_buffer_keeps_the_last_n_finished(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(trace_buffer_size=3)
    for i, prompt in enumerate(make_prompts([5] * 5)):
        await submit(engine, f"r{i}", prompt, greedy(2))
    assert [engine.get_trace(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert [r["rid"] for r in engine.recent_traces(10)] == ["r4", "r3", "r2"]
    assert [r["rid"] for r in engine.recent_traces(2)] == ["r4", "r3"]


def test_a_zero_buffer_keeps_nothing_and_a_reused_rid_replaces_its_trace() -> None:
    none = TraceStore(0)
    none.put(RequestTrace("a", 0.0, 1))
    assert none.get("a") is None and len(none) == 0
    store = TraceStore(2)
    old, new = RequestTrace("a", 0.0, 1), RequestTrace("a", 1.0, 2)
    for trace in (old, RequestTrace("b", 0.5, 1), new):
        store.put(trace)
    assert store.get("a") is new and [t.rid for t in store.recent(5)] == ["a", "b"]


def test_a_failing_exporter_does_not_fail_the_request(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()

    def broken(trace: RequestTrace) -> None:
        raise RuntimeError("collector down")

    engine.scheduler.traces.exporter = broken
    out = engine.generate(make_prompts([6])[0], greedy(3))
    assert isinstance(out, dict) and out["meta_info"]["finish_reason"] == {"type": "length", "matched": 3}


def test_traces_export_as_spans_under_the_callers_traceparent(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(chunked_prefill_size=16)
    memory = InMemorySpanExporter()
    otlp = OtlpTraceExporter(memory)
    engine.scheduler.traces.exporter = otlp
    options = TraceOptions(return_trace=True, headers=(("traceparent", TRACEPARENT),))
    out = asyncio.run(engine.async_generate(make_prompts([40])[0], greedy(4), rid="o", trace=options))
    trace = out["meta_info"]["trace"]
    assert trace["traceparent"] == TRACEPARENT
    assert engine.wait_idle()  # the export follows the last output
    assert otlp.force_flush()
    spans = memory.get_finished_spans()
    (root,) = [s for s in spans if s.name == "sluice.request"]
    assert root.context is not None and root.parent is not None
    assert root.context.trace_id == int(TRACEPARENT.split("-")[1], 16)
    assert root.parent.span_id == int(TRACEPARENT.split("-")[2], 16) and root.parent.is_remote
    assert root.attributes is not None and root.attributes["sluice.rid"] == "o"
    assert root.attributes["sluice.output_tokens"] == 4
    assert {e.name for e in root.events} >= {"first_token", "finished"}
    children = [s for s in spans if s is not root]
    assert [s.name for s in children] == [s["name"] for s in trace["spans"]] == ["tokenize", "queue", "prefill", "decode"]
    start_ns = int(trace["arrival_time"] * 1e9)
    assert root.start_time is not None and abs(root.start_time - start_ns) < 2000
    for span, expected in zip(children, trace["spans"]):
        assert span.parent is not None and span.parent.span_id == root.context.span_id
        assert span.start_time is not None and span.end_time is not None
        assert abs(span.start_time - (start_ns + expected["start"] * 1e9)) < 2000
        assert expected["end"] is not None and abs(span.end_time - (start_ns + expected["end"] * 1e9)) < 2000
    (prefill,) = [s for s in children if s.name == "prefill"]
    assert [e.name for e in prefill.events] == ["prefill_chunk"] * 3
    otlp.shutdown()


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[bytes]]]:
    """A bare OTLP/HTTP collector on a free port: the protobuf bodies it received."""
    bodies: list[bytes] = []
    handler = type("Handler", (_Collector,), {"bodies": bodies})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", bodies
    server.shutdown()


async def test_otlp_traces_endpoint_posts_the_spans(make_stub: Callable[..., Engine], collector: tuple[str, list[bytes]]) -> None:
    endpoint, bodies = collector
    engine = make_stub(otlp_traces_endpoint=endpoint)
    await submit(engine, "posted", make_prompts([12])[0], greedy(3))
    assert engine.wait_idle()  # the export follows the last output
    assert engine.trace_exporter is not None and engine.trace_exporter.force_flush()
    request = ExportTraceServiceRequest()
    for body in bodies:
        request.MergeFromString(body)
    spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert sorted(s.name for s in spans) == sorted(["sluice.request", "tokenize", "queue", "prefill", "decode"])
    service = {a.key: a.value.string_value for rs in request.resource_spans for a in rs.resource.attributes}
    assert service["service.name"] == "sluice"


def test_a_prefill_decode_pair_traces_their_queues_and_the_kv_transfer(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    prompt = make_prompts([30])[0]
    p_out, d_out = asyncio.run(pd.pair(prompt, greedy(6), trace=TraceOptions(return_trace=True)))
    prefill, decode = p_out["meta_info"]["trace"], d_out["meta_info"]["trace"]
    # The prefill half waits for its decode peer in the bootstrap queue (unless the peer's
    # prealloc came first), is prefilled here, and ends once its KV is acknowledged.
    queues = [e["queue"] for e in events(prefill, "queued")]
    assert queues[-1] == "waiting" and set(queues) <= {"bootstrap", "waiting"}, queues
    assert names(prefill)[-2:] == ["finished", "kv_sent"] and events(prefill, "kv_sent")[0]["ok"] is True
    assert [s["name"] for s in prefill["spans"]][-1] == "kv_transfer"
    # The decode half waits for a reservation, then for the KV, then decodes.
    assert [(e["queue"], e.get("kv_slots")) for e in events(decode, "queued")] == [("prealloc", None), ("transfer", 30)]
    seq = names(decode)
    assert seq.index("kv_received") < seq.index("first_token") < seq.index("finished") and "prefill_chunk" not in seq
    assert [s["name"] for s in decode["spans"]] == ["tokenize", "queue", "queue", "decode"]
    assert decode["output_tokens"] == 6 and decode["finish_reason"] == "length"
