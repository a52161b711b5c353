"""What the engine hands its callers: one `GenerateOutput` per emitted chunk.

Chunks are deltas: each carries only the text, token ids and logprobs that are new
since the previous chunk of the same request, so concatenating a stream's chunks
gives the whole output. A non-streamed request gets one chunk holding everything.
`meta_info` is a snapshot: `completion_tokens` counts every token so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NotRequired, TypedDict

TokenLogprob = tuple[float, int]  # (logprob, token_id)
PromptTokenLogprob = tuple[float | None, int]  # a prompt token's: None for the first one reported

# SGLang's warm-up address: a request bootstrapped here moves no KV whatever the backend.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


@dataclass(frozen=True, slots=True)
class BootstrapInfo:
    """Where a disaggregated request's KV comes from (sglang-router adds these fields):
    the prefill server's host and bootstrap port, and the room (a 64-bit id) that
    pairs its prefill half with its decode half."""

    host: str
    port: int
    room: int

    @property
    def addr(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def is_fake(self) -> bool:
        return self.host == FAKE_BOOTSTRAP_HOST


class FinishReasonJSON(TypedDict):
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None  # the stop token id or string, or max_new_tokens
    message: NotRequired[str]
    status_code: NotRequired[int]  # an abort the server caused (e.g. a KV transfer failed): the HTTP status


TraceValue = int | float | str | bool | None  # what a trace event's fields hold


class TraceSpanJSON(TypedDict):
    """One phase of a request (tokenize, queue, prefill, decode, kv_transfer): seconds after
    its arrival; `end` is None while the phase runs."""

    name: str
    start: float
    end: float | None
    attributes: dict[str, TraceValue]


class TraceSummaryJSON(TypedDict):
    rid: str
    state: str  # "running" | "finished"
    arrival_time: float  # unix seconds; every `t`, `start` and `end` of the trace is seconds after it
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # the radix cache's hit on the first admission
    retractions: int
    finish_reason: str | None  # "stop" | "length" | "abort", once finished
    ttft: float | None  # arrival to first token
    e2e: float | None  # arrival to finish


class TraceJSON(TraceSummaryJSON):
    """A request's timeline (runtime/managers/trace.py lists the events and their fields)."""

    traceparent: str | None  # the W3C trace context of the caller's request, when it sent one
    events: list[dict[str, TraceValue]]  # {"event": name, "t": seconds after arrival, **fields}
    spans: list[TraceSpanJSON]


class MetaInfo(TypedDict):
    id: str
    prompt_tokens: int
    completion_tokens: int  # all output tokens so far, not just this chunk's
    cached_tokens: int  # prompt tokens served from the prefix cache
    finish_reason: FinishReasonJSON | None  # set on the last chunk only
    queue_time: float
    first_token_time: float | None
    e2e_latency: float | None
    output_token_logprobs: NotRequired[list[TokenLogprob]]  # this chunk's tokens; with return_logprob
    output_top_logprobs: NotRequired[list[list[TokenLogprob]]]  # this chunk's tokens; with top_logprobs_num > 0
    # With logprob_start_len >= 0 (prompt_logprobs.py): prompt tokens [logprob_start_len, n), in the
    # first chunk after the prompt's prefill; [] in every other chunk.
    input_token_logprobs: NotRequired[list[PromptTokenLogprob]]
    input_top_logprobs: NotRequired[list[list[TokenLogprob] | None]]  # with top_logprobs_num > 0; None first
    trace: NotRequired[TraceJSON]  # the last chunk only, with return_trace


class GenerateOutput(TypedDict):
    text: str  # text released since the previous chunk (never a broken character)
    output_ids: list[int]  # token ids generated since the previous chunk
    meta_info: MetaInfo
