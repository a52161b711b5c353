"""The path every generation route shares: parse, check, admit, plan, launch, respond.

A route only says how its body becomes engine requests (`Plan`) and how their output
renders (`View`). Ownership of the admission ticket: `serve_generation` holds it until
a GenerationGroup takes it; the group holds it until `close()`; a streaming response
closes the group when it ends. So every exit path releases it exactly once.
"""

from __future__ import annotations

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

log = structlog.get_logger("sluice.app")

B = TypeVar("B", bound=GenerationBody)

# Status logged for a request whose client left before the response (nginx's convention).
CLIENT_CLOSED = 499


class View(Protocol):
    """Renders a group's output: SSE payloads from the delta chunks, or one final body."""

    def stream(self) -> AsyncIterator[Payload]: ...

    def final(self) -> Payload: ...


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
    state = app_state(request)
    body = await parse_body(request, body_model)
    check_model(state, body.requested_model())
    tokens = state.tokenizer()
    ticket = state.admit()
    try:
        planned = await plan(state, body, tokens)
        group = GenerationGroup(
            state, planned.group_id, planned.choices, ticket, arrival=arrival,
            return_logprob=planned.return_logprob, top_logprobs_num=planned.top_logprobs_num,
        )
    except BaseException:
        ticket.release()
        raise
    return await _respond(request, group, planned.render(group), stream=body.stream)


async def _stream_events(group: GenerationGroup, view: View) -> AsyncIterator[bytes]:
    """SSE bytes for the view's payloads, then [DONE]; an error mid-stream becomes an error event."""
    try:
        async for payload in view.stream():
            yield sse_event(payload)
    except APIError as exc:
        yield sse_event(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception as exc:  # noqa: BLE001 - headers are sent; the error must go in-band
        log.error("error while streaming", group=group.id, exc_info=exc)
        yield sse_event(error_body(500, f"Internal server error: {type(exc).__name__}"))
    finally:
        group.close()
    yield SSE_DONE


async def _respond(request: Request, group: GenerationGroup, view: View, *, stream: bool) -> Response:
    """Launch `group`, then answer with SSE or one JSON body; closes the group on every path."""
    handed_over = False
    try:
        group.launch()
        if stream:
            await until_disconnect(request, group.start())
            response = SSEResponse(_stream_events(group, view), on_close=group.close)
            handed_over = True
            return response
        await until_disconnect(request, group.run_to_end())
        return JSONResponse(view.final())
    except ClientDisconnected:
        log.info("client disconnected; request aborted", group=group.id)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not handed_over:
            group.close()
