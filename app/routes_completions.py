"""POST /v1/completions (OpenAI legacy completions, batch prompts, echo, logprobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from app.errors import APIError
from app.generation import Choice, GenerationGroup
from app.openai_format import EchoedPrompt, completion_logprobs, finish_reason, new_id, new_logprobs, now, usage
from app.protocol import CompletionRequest
from app.responses import Payload
from app.sampling import for_choice, request_priority, sampling_params
from app.serving import Plan, check_context, serve_generation
from app.state import AppState
from app.tokens import TokenizerService


async def create_completion(request: Request) -> Response:
    return await serve_generation(request, CompletionRequest, _plan)


async def _plan(state: AppState, req: CompletionRequest, tokens: TokenizerService) -> Plan:
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
    group_id = new_id("cmpl")
    choices = []
    boots = req.bootstraps(len(prompt_ids), req.n)
    # echo with logprobs scores the prompt: its first choice asks, the others share that.
    score_prompt = req.echo and req.logprobs is not None
    priority = request_priority(req.priority)
    for p, ids in enumerate(prompt_ids):
        params = sampling_params(req, check_context(len(ids), req.max_tokens, state.context_len))
        for j in range(req.n):
            index = p * req.n + j
            rid = group_id if len(prompt_ids) * req.n == 1 else f"{group_id}-{index}"
            start = 0 if score_prompt and j == 0 else -1
            choices.append(Choice(index, rid, ids, for_choice(params, index), boots[index], start, priority))
    return Plan(
        group_id, choices, lambda group: _CompletionView(state, req, group, tokens, prompt_texts),
        return_logprob=req.logprobs is not None, top_logprobs_num=req.logprobs or 0,
    )


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
        self.head: Payload = {"id": group.id, "object": "text_completion", "created": now(), "model": state.model_name}

    def _echo(self, choice: Choice) -> str:
        return self.prompt_texts[choice.index // self.req.n] if self.req.echo else ""

    def _prompt_logprobs(self, choice: Choice) -> EchoedPrompt:
        """The echoed prompt's logprobs, which the prompt's first choice computed."""
        first = self.group.choices[choice.index - choice.index % self.req.n]
        return EchoedPrompt(choice.prompt_ids, first.prompt_logprobs, first.prompt_top_logprobs)

    def final(self) -> Payload:
        out = []
        for choice in self.group.choices:
            lp = None
            if self.req.logprobs is not None:
                echo = self._prompt_logprobs(choice) if self.req.echo else None
                lp, _ = completion_logprobs(self.tokens, choice.token_logprobs, choice.top_logprobs, 0, echo)
            reason = finish_reason(choice.final_meta()) or "abort"
            out.append({"index": choice.index, "text": self._echo(choice) + choice.text, "logprobs": lp, "finish_reason": reason})
        return {**self.head, "choices": out, "usage": usage(self.group.choices, self.req.n), "system_fingerprint": None}

    def _chunk(self, index: int, text: str, logprobs: Payload | None, reason: str | None) -> Payload:
        chunk = {**self.head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def stream(self) -> AsyncIterator[Payload]:
        want_logprobs = self.req.logprobs is not None
        # OpenAI's `text_offset` is each token's position in the choice's whole text, so
        # the stream carries the running length of the token texts sent so far.
        text_offsets = [0] * len(self.group.choices)
        if self.req.echo:
            for choice in self.group.choices:
                text, lp = self._echo(choice), None
                if want_logprobs:
                    echo = self._prompt_logprobs(choice)
                    lp, text_offsets[choice.index] = completion_logprobs(self.tokens, [], [], 0, echo)
                else:
                    text_offsets[choice.index] = len(text)
                yield self._chunk(choice.index, text, lp, None)
        async for index, chunk in self.group.events():
            meta = chunk["meta_info"]
            reason = finish_reason(meta)
            sampled, tops = new_logprobs(meta)
            lp = None
            if want_logprobs and sampled:
                lp, text_offsets[index] = completion_logprobs(self.tokens, sampled, tops, text_offsets[index])
            if chunk["text"] or reason is not None or lp is not None:
                yield self._chunk(index, chunk["text"], lp, reason)
        if self.req.include_usage:
            yield {**self.head, "choices": [], "usage": usage(self.group.choices, self.req.n)}
