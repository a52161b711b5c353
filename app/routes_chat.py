"""POST /v1/chat/completions (chat template applied off the loop)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from app.generation import Choice, GenerationGroup
from app.openai_common import app_state, check_context, check_model, parse_body, respond
from app.openai_format import (
    chat_logprobs,
    finish_reason,
    logprob_count,
    new_id,
    now,
    usage,
)
from app.protocol import ChatCompletionRequest
from app.sampling import for_choice, openai_sampling_params
from app.state import AppState
from app.tokens import TokenizerService


async def create_chat_completion(request: Request) -> Response:
    arrival = time.perf_counter()
    state = app_state(request)
    req = await parse_body(request, ChatCompletionRequest)
    check_model(state, req.model)
    tokens = state.tokenizer()
    ticket = state.admit()
    try:
        prompt = await tokens.apply_chat_template([m.for_template() for m in req.messages])
        # The template already holds the special tokens (BOS, role markers).
        prompt_ids = await tokens.encode(prompt, add_special_tokens=False)
        max_new = check_context(len(prompt_ids), req.requested_max_tokens, state.context_len, unit="messages")
        params = openai_sampling_params(req, max_new)
        group_id = new_id("chatcmpl")
        choices = [
            Choice(i, group_id if req.n == 1 else f"{group_id}-{i}", prompt_ids, for_choice(params, req.seed, i))
            for i in range(req.n)
        ]
        group = GenerationGroup(
            state, group_id, choices, ticket, arrival=arrival,
            return_logprob=req.logprobs, top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
        )
    except BaseException:
        ticket.release()
        raise
    view = _ChatView(state, req, group, tokens)
    return await respond(request, group, stream=req.stream, stream_payloads=view.stream, final_payload=view.final)


class _ChatView:
    """Renders one chat request's group as OpenAI chat objects."""

    def __init__(self, state: AppState, req: ChatCompletionRequest, group: GenerationGroup, tokens: TokenizerService) -> None:
        self.req = req
        self.group = group
        self.tokens = tokens
        self.created = now()
        self.model = state.model_name

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.group.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    async def final(self) -> dict[str, Any]:
        out = []
        for choice in self.group.choices:
            final = choice.final()
            out.append({
                "index": choice.index,
                "message": {"role": "assistant", "content": final.get("text") or ""},
                "logprobs": chat_logprobs(self.tokens, final, 0) if self.req.logprobs else None,
                "finish_reason": finish_reason(final) or "abort",
            })
        return {**self._head("chat.completion"), "choices": out, "usage": usage(self.group.choices, self.req.n)}

    @property
    def _include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def _chunk(self, index: int, delta: dict[str, Any], logprobs: Any, reason: str | None) -> dict[str, Any]:
        chunk = {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}],
        }
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        for choice in self.group.choices:
            yield self._chunk(choice.index, {"role": "assistant", "content": ""}, None, None)
        async for index, chunk in self.group.events():
            choice = self.group.choices[index]
            delta = chunk.get("delta") or ""
            reason = finish_reason(chunk)
            lp = None
            if self.req.logprobs:
                start, count = choice.sent.get("logprobs", 0), logprob_count(chunk)
                if count > start:
                    lp = chat_logprobs(self.tokens, chunk, start)
                    choice.sent["logprobs"] = count
            if delta or reason is not None or lp is not None:
                yield self._chunk(index, {"content": delta} if delta else {}, lp, reason)
        if self._include_usage:
            yield {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(self.group.choices, self.req.n)}
