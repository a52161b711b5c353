"""POST /v1/completions (OpenAI legacy completions, batch prompts, echo, logprobs)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.errors import APIError
from app.generation import Choice, GenerationGroup
from app.openai_common import app_state, check_context, check_model, parse_body, respond
from app.openai_format import (
    completion_logprobs,
    finish_reason,
    logprob_count,
    new_id,
    now,
    usage,
)
from app.protocol import CompletionRequest
from app.sampling import for_choice, openai_sampling_params
from app.state import AppState
from app.tokens import TokenizerService


async def create_completion(request: Request) -> Response:
    arrival = time.perf_counter()
    state = app_state(request)
    req = await parse_body(request, CompletionRequest)
    check_model(state, req.model)
    tokens = state.tokenizer()
    ticket = state.admit()
    try:
        prompt_ids: list[list[int]] = []
        prompt_texts: list[str] = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                ids = await tokens.encode(prompt)
                text = prompt
            else:
                tokens.check_ids(prompt, "prompt")
                ids = prompt
                text = await tokens.decode(prompt) if req.echo else ""
            if not ids:
                raise APIError(400, "The prompt is empty (it tokenizes to no tokens).", param="prompt")
            prompt_ids.append(ids)
            prompt_texts.append(text)
        context_len = state.context_len
        max_new = [check_context(len(ids), req.max_tokens, context_len) for ids in prompt_ids]
        group_id = new_id("cmpl")
        choices = []
        for p, ids in enumerate(prompt_ids):
            params = openai_sampling_params(req, max_new[p])
            for j in range(req.n):
                index = p * req.n + j
                rid = group_id if len(prompt_ids) * req.n == 1 else f"{group_id}-{index}"
                choices.append(Choice(index, rid, ids, for_choice(params, req.seed, index)))
        group = GenerationGroup(
            state, group_id, choices, ticket, arrival=arrival,
            return_logprob=req.logprobs is not None, top_logprobs_num=req.logprobs or 0,
        )
    except BaseException:
        ticket.release()
        raise
    view = _CompletionView(state, req, group, tokens, prompt_texts)
    return await respond(request, group, stream=req.stream, stream_payloads=view.stream, final_payload=view.final)


class _CompletionView:
    """Renders one completions request's group as OpenAI objects."""

    def __init__(
        self, state: AppState, req: CompletionRequest, group: GenerationGroup, tokens: TokenizerService,
        prompt_texts: list[str],
    ) -> None:
        self.req = req
        self.group = group
        self.tokens = tokens
        self.prompt_texts = prompt_texts
        self.head = {"id": group.id, "object": "text_completion", "created": now(), "model": state.model_name}

    def _prompt_of(self, choice: Choice) -> int:
        return choice.index // self.req.n

    async def final(self) -> dict[str, Any]:
        out = []
        for choice in self.group.choices:
            final = choice.final()
            text = final.get("text") or ""
            lp = None
            if self.req.echo:
                text = self.prompt_texts[self._prompt_of(choice)] + text
            if self.req.logprobs is not None:
                echo_ids = choice.prompt_ids if self.req.echo else None
                lp, _ = completion_logprobs(self.tokens, final, 0, 0, echo_ids)
            out.append({"index": choice.index, "text": text, "logprobs": lp, "finish_reason": finish_reason(final) or "abort"})
        return {**self.head, "choices": out, "usage": usage(self.group.choices, self.req.n), "system_fingerprint": None}

    def _chunk(self, index: int, text: str, logprobs: Any, reason: str | None) -> dict[str, Any]:
        chunk = {**self.head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    @property
    def _include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        want_logprobs = self.req.logprobs is not None
        if self.req.echo:
            for choice in self.group.choices:
                text = self.prompt_texts[self._prompt_of(choice)]
                lp = None
                if want_logprobs:
                    empty: dict[str, Any] = {"meta_info": {}}
                    lp, choice.sent["offset"] = completion_logprobs(self.tokens, empty, 0, 0, choice.prompt_ids)
                else:
                    choice.sent["offset"] = len(text)
                yield self._chunk(choice.index, text, lp, None)
        async for index, chunk in self.group.events():
            choice = self.group.choices[index]
            delta = chunk.get("delta") or ""
            reason = finish_reason(chunk)
            lp = None
            if want_logprobs:
                start, count = choice.sent.get("logprobs", 0), logprob_count(chunk)
                if count > start:
                    lp, choice.sent["offset"] = completion_logprobs(self.tokens, chunk, start, choice.sent.get("offset", 0))
                    choice.sent["logprobs"] = count
            if delta or reason is not None or lp is not None:
                yield self._chunk(index, delta, lp, reason)
        if self._include_usage:
            yield {**self.head, "choices": [], "usage": usage(self.group.choices, self.req.n)}
