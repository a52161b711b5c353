"""Native (SGLang-style) routes: /generate, cache and request control, server info."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.body import parse_body
from app.errors import APIError
from app.generation import Choice, GenerationGroup
from app.native_protocol import AbortRequest, GenerateRequest, SamplingParamsBody
from app.responses import JSONResponse, Payload
from app.sampling import request_priority, sampling_params
from app.serving import Plan, app_state, check_context, serve_generation
from app.state import AppState
from app.tokens import TokenizerService
from runtime.managers.io_struct import PromptTokenLogprob, TokenLogprob
from runtime.sampling_params import DEFAULT_MAX_NEW_TOKENS

VERSION = "0.1.0"


async def generate(request: Request) -> Response:
    return await serve_generation(request, GenerateRequest, _plan)


async def _plan(state: AppState, req: GenerateRequest, tokens: TokenizerService) -> Plan:
    prompts = req.prompts()
    boots = req.bootstraps(len(prompts), 1)
    group_id = req.rid if isinstance(req.rid, str) else uuid.uuid4().hex
    choices = []
    spans = req.spans()
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = await tokens.encode(prompt)
        else:
            ids = prompt
            tokens.check_ids(ids, "input_ids")
        if not ids:
            raise APIError(400, "The prompt is empty (it tokenizes to no tokens).", param="text")
        body = (req.sampling_params[i] if isinstance(req.sampling_params, list) else req.sampling_params) or SamplingParamsBody()
        max_new = check_context(len(ids), body.max_new_tokens, state.context_len, default=DEFAULT_MAX_NEW_TOKENS)
        rid = req.rid[i] if isinstance(req.rid, list) else group_id if not req.batched else f"{group_id}-{i}"
        start = req.logprob_start_len[i] if isinstance(req.logprob_start_len, list) else req.logprob_start_len
        priority = request_priority(req.priority[i] if isinstance(req.priority, list) else req.priority)
        choices.append(Choice(i, rid, ids, sampling_params(body, max_new), boots[i], start, priority, answer_spans=spans[i]))
    return Plan(
        group_id, choices, lambda group: _NativeView(group, req.batched, tokens, req.return_text_in_logprobs),
        return_logprob=req.return_logprob or req.top_logprobs_num > 0, top_logprobs_num=req.top_logprobs_num,
    )


class _NativeView:
    """SGLang's native output: every event carries the whole output so far plus `delta`;
    a batch answers with a list, and its stream's events carry their prompt's `index`.

    Prompt logprob entries take SGLang's shape, [logprob, token_id, text or null] (text with
    return_text_in_logprobs, which also gives the output's entries their text; without
    it those stay [logprob, token_id])."""

    def __init__(self, group: GenerationGroup, batched: bool, tokens: TokenizerService, with_text: bool) -> None:
        self.group = group
        self.batched = batched
        self.tokens = tokens
        self.with_text = with_text

    def _whole(self, index: int) -> Payload:
        whole = self.group.choices[index].cumulative()
        meta: dict[str, Any] = dict(whole["meta_info"])
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in meta and (key.startswith("input") or self.with_text):
                meta[key] = [self._entry(e) for e in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs"):
            if key in meta and (key.startswith("input") or self.with_text):
                meta[key] = [None if top is None else [self._entry(e) for e in top] for top in meta[key]]
        return {"text": whole["text"], "output_ids": whole["output_ids"], "meta_info": meta}

    def _entry(self, entry: PromptTokenLogprob | TokenLogprob) -> list[float | int | str | None]:
        logprob, token_id = entry
        return [logprob, token_id, self.tokens.token_text(token_id) if self.with_text else None]

    def final(self) -> Payload | list[Payload]:
        outs = [self._whole(i) for i in range(len(self.group.choices))]
        return outs if self.batched else outs[0]

    async def stream(self) -> AsyncIterator[Payload]:
        async for index, chunk in self.group.events():
            whole = self._whole(index)
            event: Payload = {"text": whole["text"], "delta": chunk["text"], "output_ids": whole["output_ids"],
                              "meta_info": whole["meta_info"]}
            yield {**event, "index": index} if self.batched else event


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
        "is_generation": not engine.settings.is_embedding,
        "served_model_name": state.model_name,
    })


async def get_server_info(request: Request) -> Response:
    state = app_state(request)
    engine = state.ready_engine()
    server = dataclasses.asdict(state.server)
    server["api_key"] = None if state.server.api_key is None else "<redacted>"
    return JSONResponse({
        **dataclasses.asdict(engine.settings),  # as resolved at start-up (SGLang returns its server args)
        **server,
        **engine.get_server_info(),
        "served_model_name": state.model_name,
        "phase": state.phase.value,
        "inflight_requests": state.inflight,
        "version": VERSION,
    })


async def get_load(request: Request) -> Response:
    """SGLang's load report, one entry per data-parallel rank (sluice has one), as
    sglang-router reads it for its power-of-two policy and its GET /get_loads.
    num_tokens counts the KV tokens requests hold (evictable cached prefixes count as
    free); unlike SGLang it leaves out the prompt tokens still waiting in the queue."""
    info = app_state(request).ready_engine().get_server_info()
    held = info["max_total_num_tokens"] - info["available_kv_tokens"] - info["evictable_kv_tokens"]
    waiting = info["num_waiting_reqs"]
    return JSONResponse([{
        "dp_rank": 0,
        "num_reqs": info["num_running_reqs"] + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": held,
    }])
