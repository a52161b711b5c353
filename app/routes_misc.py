"""Probes, metrics, the model list and (de)tokenization."""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog
from starlette.requests import Request
from starlette.responses import Response

from app.body import parse_body
from app.errors import APIError
from app.metrics import CONTENT_TYPE
from app.native_protocol import DetokenizeRequest, TokenizeRequest
from app.responses import JSONResponse
from app.serving import app_state, check_model
from app.state import AppState, Phase
from runtime.sampling_params import SamplingParams

log = structlog.get_logger("sluice.app")

STARTED_AT = int(time.time())


def _not_serving(state: AppState) -> APIError | None:
    if state.phase is Phase.STARTING:
        return APIError(503, "The server is starting.", code="server_starting")
    if state.phase is Phase.DRAINING:
        return APIError(503, "The server is shutting down.", code="server_shutting_down")
    if state.phase is Phase.FAILED:
        return APIError(503, f"The engine failed: {state.failure}", code="engine_failed")
    return None


async def health(request: Request) -> Response:
    """Cheap liveness/readiness: 200 only while serving."""
    error = _not_serving(app_state(request))
    if error is not None:
        raise error
    return JSONResponse({"status": "ok"})


async def health_generate(request: Request) -> Response:
    """Generates one token end to end; on timeout aborts its own request and answers 503."""
    state = app_state(request)
    error = _not_serving(state)
    if error is not None:
        raise error
    engine = state.ready_engine()
    rid = f"health-generate-{uuid.uuid4().hex}"
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    try:
        # Cancelling the awaiting task aborts the request (engine contract).
        if engine.settings.is_embedding:  # (an embedding server answers with one embedding)
            generate = engine.async_encode([0], rid=rid)
        else:
            generate = engine.async_generate([0], params, rid=rid, bootstrap=engine.self_check_bootstrap())
        await asyncio.wait_for(generate, state.server.health_generate_timeout)
    except TimeoutError:
        engine.abort(rid)
        log.warning("health_generate timed out", rid=rid, timeout=state.server.health_generate_timeout)
        raise APIError(503, "The engine did not generate a token in time.", code="engine_unhealthy") from None
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(app_state(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(state: AppState) -> dict[str, object]:
    engine = state.ready_engine()
    return {
        "id": state.model_name,
        "object": "model",
        "created": STARTED_AT,
        "owned_by": "sluice",
        "root": engine.settings.model_path or state.model_name,
        "parent": None,
        "max_model_len": state.context_len,
    }


async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(app_state(request))]})


async def retrieve_model(request: Request) -> Response:
    state = app_state(request)
    model_id = request.path_params["model_id"]
    if model_id != state.model_name:
        raise APIError(404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found")
    return JSONResponse(_model_card(state))


async def tokenize(request: Request) -> Response:
    state = app_state(request)
    req = await parse_body(request, TokenizeRequest)
    check_model(state, req.model)
    tokens = state.tokenizer()
    if req.messages is not None:
        text = await tokens.apply_chat_template([m.for_template() for m in req.messages])
        add_special = False if req.add_special_tokens is None else req.add_special_tokens
    else:
        assert req.prompt is not None
        text = req.prompt
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
    ids = await tokens.encode(text, add_special_tokens=add_special)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.context_len})


async def detokenize(request: Request) -> Response:
    state = app_state(request)
    req = await parse_body(request, DetokenizeRequest)
    check_model(state, req.model)
    text = await state.tokenizer().decode(list(req.tokens))
    return JSONResponse({"prompt": text})
