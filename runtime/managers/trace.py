"""Per-request traces: what the scheduler did with each request, and when.

A `RequestTrace` is an append-only list of (event, time.monotonic(), fields) records,
written at scheduling decisions only, never once per decode step: the decode is read
off the first_token, retracted and finished records, which carry the output count.
The events and their fields:

  arrival          the caller received the request (before tokenizing)
  tokenized        prompt_tokens
  queued           queue ("waiting", "bootstrap", "prealloc", "transfer"; "grammar" when it
                   exists), kv_slots (transfer: the slots reserved for the prompt). The request
                   waits there until its next record.
  prefill_chunk    new_tokens, cached_tokens (KV already there: a radix hit or earlier chunks),
                   batch_size (requests this prefill runs), running (decodes beside it),
                   kv_slots (what the request holds once the chunk has run), more (another
                   chunk follows). The first chunk of an admission adds cache_hit (the radix
                   match) and readmitted (after a retraction).
  prefilled        the admission's last chunk has been computed
  first_token
  retracted        output_tokens, kv_slots (its KV went to the radix cache; it waits again)
  preempted        as retracted, to make room for a higher-priority request: by (its rid), priority
  abort_requested  why ("abort_request", "client_disconnected", "stream_closed", "cancelled",
                   "consumer_gone")
  kv_received      (decode server) the prompt's KV arrived from the prefill server
  finished         reason, message, output_tokens, kv_slots (donated to the cache or freed)
  kv_sent          (prefill server, after finished) ok, error: the KV transfer ended

`phases` turns the records into spans (tokenize, queue, prefill, decode, kv_transfer),
which the JSON, the dashboard's timeline and the OTLP export share. Times are
monotonic; the JSON gives seconds after arrival plus the arrival's unix time, from
one monotonic -> unix offset read at import.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from runtime.managers.io_struct import TraceJSON, TraceSpanJSON, TraceSummaryJSON, TraceValue

log = structlog.get_logger("sluice.trace")

Fields = dict[str, TraceValue]
Record = tuple[str, float, Fields | None]  # (event, time.monotonic(), fields)

MONO_TO_UNIX = time.time() - time.monotonic()  # read once: wall = monotonic + MONO_TO_UNIX

# Records that mark an instant of the request as a whole (OTLP: events of the request span).
INSTANTS = frozenset({"first_token", "retracted", "preempted", "abort_requested", "kv_received", "finished"})


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """What a caller asks of one request's trace."""

    return_trace: bool = False  # add it to the last output's meta_info["trace"]
    headers: tuple[tuple[str, str], ...] = ()  # W3C trace context (traceparent, tracestate) of the caller
    arrival: float | None = None  # time.monotonic() when the caller received it; None: when the engine did


NO_OPTIONS = TraceOptions()


class RequestTrace:
    """The timeline of one request. Only the scheduler's loop appends (the engine writes
    the first two records before handing the request over); readers copy `events`."""

    __slots__ = ("rid", "events", "options", "prompt_tokens", "output_tokens", "cached_tokens", "retractions",
                 "first_token_at", "finish_reason", "end")

    def __init__(self, rid: str, created: float, prompt_tokens: int) -> None:
        self.rid = rid
        self.events: list[Record] = [("arrival", created, None)]
        self.options = NO_OPTIONS
        self.prompt_tokens = prompt_tokens
        self.output_tokens = 0  # as of the last retracted/finished record
        self.cached_tokens = 0  # the radix hit of the first admission
        self.retractions = 0
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None
        self.end: float | None = None  # set by `finished`

    def add(self, event: str, fields: Fields | None = None) -> float:
        t = time.monotonic()
        self.events.append((event, t, fields))
        return t

    # ---- the events (module docstring) ----------------------------------------------------
    def received(self, arrival: float, options: TraceOptions | None) -> None:
        """The engine took the request: it arrived at `arrival` (or the caller's
        `options.arrival`) and was tokenized when this trace was created (with its Req)."""
        if options is not None and options.arrival is not None:
            arrival = options.arrival
        created = self.events[0][1]
        self.events[0] = ("arrival", min(arrival, created), None)
        self.events.insert(1, ("tokenized", created, {"prompt_tokens": self.prompt_tokens}))
        if options is not None:
            self.options = options

    def queued(self, queue: str, kv_slots: int | None = None) -> None:
        self.add("queued", {"queue": queue} if kv_slots is None else {"queue": queue, "kv_slots": kv_slots})

    def prefill_chunk(self, new_tokens: int, cached_tokens: int, batch_size: int, running: int, more: bool,
                      admitted: bool) -> None:
        fields: Fields = {"new_tokens": new_tokens, "cached_tokens": cached_tokens, "batch_size": batch_size,
                          "running": running, "kv_slots": cached_tokens + new_tokens, "more": more}
        if admitted:
            fields["cache_hit"] = cached_tokens
            fields["readmitted"] = self.retractions > 0
            if self.retractions == 0:
                self.cached_tokens = cached_tokens
        self.add("prefill_chunk", fields)

    def prefilled(self) -> None:
        self.add("prefilled")

    def first_token(self) -> None:
        self.first_token_at = self.add("first_token")

    def retracted(self, output_tokens: int, kv_slots: int) -> None:
        self.retractions += 1
        self.output_tokens = output_tokens
        self.add("retracted", {"output_tokens": output_tokens, "kv_slots": kv_slots})

    def preempted(self, output_tokens: int, kv_slots: int, by: str, priority: int) -> None:
        self.retractions += 1
        self.output_tokens = output_tokens
        self.add("preempted", {"output_tokens": output_tokens, "kv_slots": kv_slots, "by": by, "priority": priority})

    def abort_requested(self, why: str) -> None:
        self.add("abort_requested", {"why": why})

    def kv_received(self) -> None:
        self.add("kv_received")

    def finished(self, reason: str, message: str | None, output_tokens: int, kv_slots: int) -> None:
        self.finish_reason = reason
        self.output_tokens = output_tokens
        self.end = self.add("finished", {"reason": reason, "message": message, "output_tokens": output_tokens,
                                         "kv_slots": kv_slots})

    def kv_sent(self, error: str | None) -> None:
        self.add("kv_sent", {"ok": error is None, "error": error})

    # ---- JSON ---------------------------------------------------------------------------
    @property
    def arrival(self) -> float:
        return self.events[0][1]

    def summary(self, output_tokens: int | None = None) -> TraceSummaryJSON:
        """`output_tokens`: the live count of a running request (the trace's own is as of
        its last retracted/finished record)."""
        t0 = self.arrival
        return {
            "rid": self.rid,
            "state": "running" if self.end is None else "finished",
            "arrival_time": t0 + MONO_TO_UNIX,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens if output_tokens is None else output_tokens,
            "cached_tokens": self.cached_tokens,
            "retractions": self.retractions,
            "finish_reason": self.finish_reason,
            "ttft": None if self.first_token_at is None else self.first_token_at - t0,
            "e2e": None if self.end is None else self.end - t0,
        }

    def to_json(self, output_tokens: int | None = None) -> TraceJSON:
        records = list(self.events)  # a copy: the scheduler may append meanwhile (another thread)
        t0 = records[0][1]
        spans, _ = phases(records)
        s = self.summary(output_tokens)
        return {
            "rid": s["rid"], "state": s["state"], "arrival_time": s["arrival_time"], "prompt_tokens": s["prompt_tokens"],
            "output_tokens": s["output_tokens"], "cached_tokens": s["cached_tokens"], "retractions": s["retractions"],
            "finish_reason": s["finish_reason"], "ttft": s["ttft"], "e2e": s["e2e"],
            "traceparent": self.traceparent,
            "events": [{"event": name, "t": t - t0, **(fields or {})} for name, t, fields in records],
            "spans": [span.to_json(t0) for span in spans],
        }

    @property
    def traceparent(self) -> str | None:
        return next((v for k, v in self.options.headers if k == "traceparent"), None)


@dataclass(slots=True)
class Span:
    """One phase of a request; `end` is None while it runs. (Mutable: `phases` builds it
    record by record; nothing keeps one after.)"""

    name: str
    start: float
    end: float | None = None
    attributes: Fields = field(default_factory=dict)
    events: list[Record] = field(default_factory=list)  # a prefill's chunks

    def to_json(self, t0: float) -> TraceSpanJSON:
        return {"name": self.name, "start": self.start - t0, "end": None if self.end is None else self.end - t0,
                "attributes": self.attributes}


def phases(records: Sequence[Record]) -> tuple[list[Span], list[Record]]:
    """The phases between the records, by start time, and the records that mark an
    instant of the whole request (INSTANTS). Each record of a phase change closes the
    phase before it; finished closes the last one."""
    spans: list[Span] = []
    instants: list[Record] = []
    current: Span | None = None
    finished_at: float | None = None
    for record in records:
        name, t, fields = record
        f = fields or {}
        if name in INSTANTS:
            instants.append(record)
        opened: Span | None = None
        if name == "tokenized":
            spans.append(Span("tokenize", records[0][1], t))
            continue
        if name == "queued":
            opened = Span("queue", t, attributes=dict(f))
        elif name == "prefill_chunk":
            if current is None or current.name != "prefill":
                opened = Span("prefill", t, attributes={"chunks": 0, "new_tokens": 0, "cache_hit": f.get("cache_hit", 0),
                                                        "readmitted": f.get("readmitted", False)})
            prefill = opened or current
            assert prefill is not None
            _count(prefill.attributes, "chunks", 1)
            _count(prefill.attributes, "new_tokens", f.get("new_tokens"))
            prefill.events.append(record)
            if opened is None:
                continue
        elif name == "prefilled" or (name == "first_token" and (current is None or current.name != "decode")):
            opened = Span("decode", t)
        elif name in ("retracted", "preempted"):
            opened = Span("queue", t, attributes={"queue": "waiting", "retracted": True})
            if name == "preempted":
                opened.attributes["preempted_by"] = f.get("by")
        elif name == "kv_sent" and finished_at is not None:
            spans.append(Span("kv_transfer", finished_at, t, {"ok": f.get("ok"), "error": f.get("error")}))
            continue
        elif name == "finished":
            finished_at = t
        else:
            continue
        if current is not None:
            current.end = t
            if "output_tokens" in f and current.name == "decode":
                current.attributes["output_tokens"] = f["output_tokens"]
            spans.append(current)
        current = opened
    if current is not None:
        spans.append(current)  # the phase a running request is in
    spans.sort(key=lambda s: s.start)
    return spans, instants


def _count(attributes: Fields, key: str, n: TraceValue) -> None:
    total = attributes.get(key)
    attributes[key] = (total if isinstance(total, int) else 0) + (n if isinstance(n, int) else 0)


class TraceStore:
    """The traces of the last `capacity` finished requests, by rid (a rid used again
    replaces the older trace); `export` hands a finished one to `exporter` (OTLP).
    Only the scheduler's loop writes; a reader on another thread sees whole entries."""

    def __init__(self, capacity: int, exporter: Callable[[RequestTrace], None] | None = None) -> None:
        self.capacity = capacity
        self.exporter = exporter
        self._done: collections.OrderedDict[str, RequestTrace] = collections.OrderedDict()

    def put(self, trace: RequestTrace) -> None:
        if self.capacity > 0:
            self._done.pop(trace.rid, None)
            self._done[trace.rid] = trace
            if len(self._done) > self.capacity:
                self._done.popitem(last=False)

    def export(self, trace: RequestTrace) -> None:
        if self.exporter is not None:
            try:
                self.exporter(trace)
            except Exception:  # noqa: BLE001 - a failing exporter must never end the scheduler's round
                log.warning("trace export failed", rid=trace.rid, exc_info=True)

    def get(self, rid: str) -> RequestTrace | None:
        return self._done.get(rid)

    def recent(self, limit: int) -> list[RequestTrace]:
        """The last `limit` finished, newest first."""
        newest = list(self._done.values())[::-1]
        return newest[:limit]

    def __len__(self) -> int:
        return len(self._done)
