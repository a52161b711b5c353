"""Steps shared by the OpenAI routes: parse, check, run a GenerationGroup, respond.

Ownership of the admission ticket: the handler holds it until a GenerationGroup
takes it; the group holds it until `close()`; a streaming response closes the group
when it ends. So every exit path releases it exactly once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pydantic
import structlog
from starlette.requests import Request
from starlette.responses import Response

from app.disconnect import ClientDisconnected, until_disconnect
from app.errors import APIError, error_body, from_validation_error
from app.generation import GenerationGroup
from app.responses import SSE_DONE, JSONResponse, SSEResponse, sse_event
from app.state import AppState

log = structlog.get_logger("sluice.app")

M = TypeVar("M", bound=pydantic.BaseModel)

# Status logged for a request whose client left before the response (nginx's convention).
CLIENT_CLOSED = 499


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.sluice
    return state


async def parse_body(request: Request, model: type[M]) -> M:
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from exc


def check_model(state: AppState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def check_context(prompt_len: int, max_tokens: int | None, context_len: int, *, unit: str = "prompt") -> int:
    """The max_new_tokens to use: `max_tokens`, or all the context left. 400 if over."""
    if prompt_len >= context_len:
        raise APIError(
            400,
            f"This model's maximum context length is {context_len} tokens. However, your {unit} has "
            f"{prompt_len} tokens, which leaves no room for the completion.",
            param="messages" if unit == "messages" else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return context_len - prompt_len
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


async def stream_events(
    group: GenerationGroup, events: Callable[[], AsyncIterator[dict[str, Any]]]
) -> AsyncIterator[bytes]:
    """SSE bytes for `events()`, then [DONE]; an error mid-stream becomes an error event."""
    try:
        async for payload in events():
            yield sse_event(payload)
    except APIError as exc:
        yield sse_event(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception as exc:  # noqa: BLE001 - headers are sent; the error must go in-band
        log.error("error while streaming", group=group.id, exc_info=exc)
        yield sse_event(error_body(500, f"Internal server error: {type(exc).__name__}"))
    finally:
        group.close()
    yield SSE_DONE


async def respond(
    request: Request,
    group: GenerationGroup,
    *,
    stream: bool,
    stream_payloads: Callable[[], AsyncIterator[dict[str, Any]]],
    final_payload: Callable[[], Awaitable[dict[str, Any]]],
) -> Response:
    """Launch `group`, then answer with SSE or one JSON body; closes the group on every path."""
    handed_over = False
    try:
        group.launch()
        if stream:
            await until_disconnect(request, group.start())
            response = SSEResponse(stream_events(group, stream_payloads), on_close=group.close)
            handed_over = True
            return response
        await until_disconnect(request, group.results())
        return JSONResponse(await final_payload())
    except ClientDisconnected:
        log.info("client disconnected; request aborted", group=group.id)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        if not handed_over:
            group.close()
