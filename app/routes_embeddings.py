"""Embedding routes of an --is-embedding server: OpenAI's POST /v1/embeddings and SGLang's
native POST /encode. On a generation server both answer 400, as SGLang's do.

Each input is one engine request (runtime/engine_requests.py RequestRoom.encode); a request's inputs run
concurrently, so the scheduler batches them. Ownership: the admission ticket is held
from before tokenization until every engine request has ended or been aborted, and a
client that leaves aborts whatever is still running (nothing is left holding KV).
"""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from app.body import parse_body
from app.disconnect import ClientDisconnected, until_disconnect
from app.embedding_protocol import EmbeddingRequest, EncodeRequest
from app.errors import APIError
from app.responses import JSONResponse, Payload
from app.serving import CLIENT_CLOSED, app_state, check_model
from app.state import AppState
from runtime.managers.embedding_manager import EmbeddingOutput

NOT_AN_EMBEDDING_SERVER = (
    "This model is not served as an embedding model: start the server with --is-embedding to use "
    "/v1/embeddings and /encode."
)


def _check_embedding_server(state: AppState) -> None:
    if not state.ready_engine().settings.is_embedding:
        raise APIError(400, NOT_AN_EMBEDDING_SERVER, code="not_an_embedding_model")


async def _token_ids(state: AppState, inputs: list[str | list[int]], param: str) -> list[list[int]]:
    """Each input's token ids (texts with the model's special tokens, as SGLang encodes them)."""
    tokens = state.tokenizer()
    for given in inputs:
        if isinstance(given, list):
            tokens.check_ids(given, param)
    encoded = iter(await asyncio.gather(*(tokens.encode(p) for p in inputs if isinstance(p, str))))
    id_lists = [next(encoded) if isinstance(p, str) else p for p in inputs]
    limit = state.context_len
    for i, ids in enumerate(id_lists):
        if not ids:
            raise APIError(400, f"Input {i} is empty (it tokenizes to no tokens).", param=param)
        if len(ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, input {i} has "
                                f"{len(ids)} tokens. Please reduce the length of the input.",
                           param=param, code="context_length_exceeded")
    return id_lists


async def _encode_all(state: AppState, id_lists: list[list[int]], rids: list[str]) -> list[EmbeddingOutput]:
    """Every input's embedding; an error or a cancellation aborts the ones still running."""
    engine = state.ready_engine()
    tasks = [asyncio.ensure_future(engine.async_encode(ids, rid=rid)) for ids, rid in zip(id_lists, rids)]
    try:
        outs = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # a cancelled async_encode aborts its request; a finished one ignores it
        await asyncio.gather(*tasks, return_exceptions=True)
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        if reason is None or reason["type"] == "abort" or out["embedding"] is None:
            why = (reason or {}).get("message") or "aborted"
            raise APIError((reason or {}).get("status_code", 503), f"The request ended before its embedding was "
                           f"computed: {why}.", code="request_aborted")
    return list(outs)


async def _serve(request: Request, state: AppState, inputs: list[str | list[int]], rids: list[str],
                 param: str) -> list[EmbeddingOutput] | Response:
    ticket = state.admit()
    try:
        id_lists = await _token_ids(state, inputs, param)
        return await until_disconnect(request, _encode_all(state, id_lists, rids))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        ticket.release()


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(request: Request) -> Response:
    """POST /v1/embeddings (OpenAI)."""
    state = app_state(request)
    body = await parse_body(request, EmbeddingRequest)
    check_model(state, body.model)
    _check_embedding_server(state)
    if body.dimensions is not None:
        raise APIError(400, "dimensions is not supported: the model has no Matryoshka representation, so its "
                            "embeddings keep their full size.", param="dimensions")
    inputs = body.inputs()
    group_id = f"embd-{uuid.uuid4().hex}"
    outs = await _serve(request, state, inputs, [f"{group_id}-{i}" for i in range(len(inputs))], "input")
    if isinstance(outs, Response):
        return outs
    data = [{"object": "embedding", "index": i, "embedding": _encoded(out["embedding"] or [], body.encoding_format)}
            for i, out in enumerate(outs)]
    used = sum(out["meta_info"]["prompt_tokens"] for out in outs)
    payload: Payload = {"object": "list", "data": data, "model": state.model_name,
                        "usage": {"prompt_tokens": used, "total_tokens": used}}
    return JSONResponse(payload, headers={"X-Request-Id": group_id})


async def encode(request: Request) -> Response:
    """POST /encode (SGLang's native): {"embedding", "meta_info"}, or a list for a batch."""
    state = app_state(request)
    body = await parse_body(request, EncodeRequest)
    _check_embedding_server(state)
    inputs = body.inputs()
    if isinstance(body.rid, list):
        rids = list(body.rid)
    else:
        rid = body.rid or uuid.uuid4().hex
        rids = [f"{rid}-{i}" for i in range(len(inputs))] if body.batched else [rid]
    outs = await _serve(request, state, inputs, rids, "text" if body.text is not None else "input_ids")
    if isinstance(outs, Response):
        return outs
    payloads = [dict(out) for out in outs]
    return JSONResponse(payloads if body.batched else payloads[0])
