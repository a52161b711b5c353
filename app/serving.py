"""The path every generation route shares: parse, check, admit, plan, launch, respond.

A route only says how its body becomes engine requests (`Plan`) and how their output
renders (`View`). Ownership of the admission ticket: `serve_generation` holds it until
a GenerationGroup takes it; the group holds it until `close()`; a streaming response
closes the group when it ends. So every exit path releases it exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import structlog
from starlette.requests import Request
from starlette.responses import Response

from app.body import parse_body
from app.disconnect import ClientDisconnected, until_disconnect
from app.errors import APIError, error_body
from app.generation import Choice, GenerationGroup
from app.protocol import GenerationBody
from app.responses import SSE_DONE, JSONResponse, Payload, SSEResponse, sse_event
from app.state import AppState
from app.tokens import TokenizerService
from runtime.managers.trace import TraceOptions

log = structlog.get_logger("sluice.app")

B = TypeVar("B", bound=GenerationBody)

# Status logged for a request whose client left before the response (nginx's convention).
CLIENT_CLOSED = 499


class View(Protocol):
    """Renders a group's output: SSE payloads from the delta chunks, or one final body."""

    def stream(self) -> AsyncIterator[Payload]: ...

    def final(self) -> Payload | list[Payload]: ...


@dataclass(slots=True)
class Plan:
    """What a route made of one request: its engine requests and how to render them."""

    group_id: str
    choices: list[Choice]
    render: Callable[[GenerationGroup], View]
    return_logprob: bool = False
    top_logprobs_num: int = 0


Planner = Callable[[AppState, B, TokenizerService], Awaitable[Plan]]


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.sluice
    return state


def check_model(state: AppState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def check_context(prompt_len: int, max_tokens: int | None, context_len: int, *, unit: str = "prompt",
                  default: int | None = None) -> int:
    """The max_new_tokens to use: `max_tokens`, else `default`, else all the context left
    (`default` is cut to the context left). 400 if over."""
    if prompt_len >= context_len:
        raise APIError(
            400,
            f"This model's maximum context length is {context_len} tokens. However, your {unit} has "
            f"{prompt_len} tokens, which leaves no room for the completion.",
            param="messages" if unit == "messages" else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        room = context_len - prompt_len
        return room if default is None else min(default, room)
    if prompt_len + max_tokens > context_len:
        raise APIError(
            400,
            f"This model's maximum context length is {context_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {unit}, {max_tokens} in the completion). "
            "Please reduce the length of the prompt or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


async def serve_generation(request: Request, body_model: type[B], plan: Planner[B]) -> Response:
    """Answer one generation request with the route's `plan`."""
    arrival = time.perf_counter()
    received = time.monotonic()  # the traces' clock
    state = app_state(request)
    body = await parse_body(request, body_model)
    check_model(state, body.requested_model())
    if state.ready_engine().settings.is_embedding:  # as SGLang: an embedding server does not generate
        raise APIError(400, "This server runs an embedding model (--is-embedding): it serves /v1/embeddings and "
                            "/encode, not generation.", code="embedding_model")
    tokens = state.tokenizer()
    ticket = state.admit()
    try:
        planned = await plan(state, body, tokens)
        if (request_id := request.headers.get("x-request-id")) is not None:
            adopt_request_id(planned, request_id)
        group = GenerationGroup(
            state, planned.group_id, planned.choices, ticket, arrival=arrival,
            return_logprob=planned.return_logprob, top_logprobs_num=planned.top_logprobs_num,
            trace=TraceOptions(body.return_trace, trace_headers(request), received),
        )
    except BaseException:
        ticket.release()
        raise
    return await _respond(request, group, planned.render(group), stream=body.stream, traces=body.return_trace)


def adopt_request_id(planned: Plan, request_id: str) -> None:
    """X-Request-Id (vLLM's header) names the request: the response id, and the engine
    rid of its one choice (of choice i: `<id>-i`), for /abort_request and traces."""
    if not 0 < len(request_id) <= 256 or not request_id.isprintable():
        raise APIError(400, "X-Request-Id must be 1 to 256 printable characters", param="X-Request-Id")
    planned.group_id = request_id
    for choice in planned.choices:
        choice.rid = request_id if len(planned.choices) == 1 else f"{request_id}-{choice.index}"


def trace_headers(request: Request) -> tuple[tuple[str, str], ...]:
    """The W3C trace context the client sent (its spans become the request's parents)."""
    return tuple((k, v) for k in ("traceparent", "tracestate") if (v := request.headers.get(k)) is not None)


def with_traces(payload: Payload, group: GenerationGroup) -> Payload:
    """OpenAI bodies have no meta_info: with return_trace, each finished choice gets one
    holding its trace. (The native body's meta_info is the engine's, trace included.)"""
    choices = payload.get("choices")
    if isinstance(choices, list):
        by_index = {c.index: c for c in group.choices}
        for entry in choices:
            if isinstance(entry, dict) and entry.get("finish_reason") is not None and entry.get("index") in by_index:
                trace = by_index[entry["index"]].final_meta().get("trace")
                if trace is not None:
                    entry["meta_info"] = {"trace": trace}
    return payload


async def _stream_events(group: GenerationGroup, view: View, traces: bool) -> AsyncIterator[bytes]:
    """SSE bytes for the view's payloads, then [DONE]; an error mid-stream becomes an error event."""
    try:
        async for payload in view.stream():
            yield sse_event(with_traces(payload, group) if traces else payload)
    except asyncio.CancelledError:
        group.close("client_disconnected")  # starlette cancels the body when the client goes away
        raise
    except APIError as exc:
        yield sse_event(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception as exc:  # noqa: BLE001 - headers are sent; the error must go in-band
        log.error("error while streaming", group=group.id, exc_info=exc)
        yield sse_event(error_body(500, f"Internal server error: {type(exc).__name__}"))
    finally:
        group.close()
    yield SSE_DONE


async def _respond(request: Request, group: GenerationGroup, view: View, *, stream: bool, traces: bool) -> Response:
    """Launch `group`, then answer with SSE or one JSON body; closes the group on every path."""
    handed_over = False
    try:
        group.launch()
        if stream:
            await until_disconnect(request, group.start())
            response: Response = SSEResponse(_stream_events(group, view, traces), on_close=lambda: group.close("client_disconnected"))
            handed_over = True
        else:
            await until_disconnect(request, group.run_to_end())
            final = view.final()  # a list only for a batched native request, whose meta_info holds its traces
            response = JSONResponse(with_traces(final, group) if traces and isinstance(final, dict) else final)
        response.headers["X-Request-Id"] = group.id
        return response
    except ClientDisconnected:
        group.close("client_disconnected")
        log.info("client disconnected; request aborted", group=group.id)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not handed_over:
            group.close()
