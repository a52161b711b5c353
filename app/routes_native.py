"""Native (SGLang-style) routes: /generate, cache and request control, server info."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.errors import APIError
from app.generation import Choice, GenerationGroup
from app.native_protocol import AbortRequest, GenerateRequest
from app.openai_common import app_state, check_context, parse_body, respond
from app.responses import JSONResponse

VERSION = "0.1.0"


async def generate(request: Request) -> Response:
    arrival = time.perf_counter()
    state = app_state(request)
    req = await parse_body(request, GenerateRequest)
    tokens = state.tokenizer()
    ticket = state.admit()
    try:
        if req.text is not None:
            ids = await tokens.encode(req.text)
        else:
            assert req.input_ids is not None
            ids = list(req.input_ids)
            tokens.check_ids(ids, "input_ids")
        if not ids:
            raise APIError(400, "The prompt is empty (it tokenizes to no tokens).", param="text")
        params = req.sampling_params.to_engine() if req.sampling_params is not None else {}
        max_new = params.get("max_new_tokens")
        check_context(len(ids), max_new if isinstance(max_new, int) else None, state.context_len)
        rid = req.rid or uuid.uuid4().hex
        group = GenerationGroup(
            state, rid, [Choice(0, rid, ids, params)], ticket, arrival=arrival,
            return_logprob=req.return_logprob or req.top_logprobs_num > 0, top_logprobs_num=req.top_logprobs_num,
        )
    except BaseException:
        ticket.release()
        raise

    async def stream() -> AsyncIterator[dict[str, Any]]:
        async for _, chunk in group.events():
            yield chunk

    async def final() -> dict[str, Any]:
        out = dict(group.choices[0].final())
        out.pop("delta", None)
        return out

    return await respond(request, group, stream=req.stream, stream_payloads=stream, final_payload=final)


async def abort_request(request: Request) -> Response:
    state = app_state(request)
    req = await parse_body(request, AbortRequest)
    engine = state.ready_engine()
    if req.abort_all:
        engine.abort_all()
        return JSONResponse({"aborted": "all"})
    assert req.rid is not None
    group = state.groups.get(req.rid)
    if group is not None:
        group.abort()  # an OpenAI response id covers all of its choices
    else:
        engine.abort(req.rid)
    return JSONResponse({"aborted": req.rid})


async def flush_cache(request: Request) -> Response:
    engine = app_state(request).ready_engine()
    if await engine.async_flush_cache():
        return JSONResponse({"flushed": True, "message": "Cache flushed."})
    raise APIError(400, "Cache not flushed: requests are running or waiting.", code="requests_running")


async def get_model_info(request: Request) -> Response:
    state = app_state(request)
    engine = state.ready_engine()
    model_path = engine.settings.model_path or getattr(engine, "model_dir", None)
    return JSONResponse({
        "model_path": model_path,
        "tokenizer_path": engine.settings.tokenizer_path or model_path,
        "is_generation": True,
        "served_model_name": state.model_name,
    })


async def get_server_info(request: Request) -> Response:
    state = app_state(request)
    engine = state.ready_engine()
    server = dataclasses.asdict(state.server)
    server["api_key"] = None if state.server.api_key is None else "<redacted>"
    return JSONResponse({
        **server,
        **engine.get_server_info(),
        "served_model_name": state.model_name,
        "phase": state.phase.value,
        "inflight_requests": state.inflight,
        "version": VERSION,
    })
