"""POST /v1/chat/completions (chat template applied off the loop)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from app.generation import Choice, GenerationGroup
from app.openai_format import chat_logprobs, finish_reason, new_id, new_logprobs, now, usage
from app.errors import APIError
from app.protocol import ChatCompletionRequest
from app.responses import Payload
from app.sampling import for_choice, request_priority, sampling_params, with_constraint
from app.serving import Plan, check_context, serve_generation
from app.state import AppState
from app.tokens import TokenizerService
from app.tools import ToolPlan


async def create_chat_completion(request: Request) -> Response:
    return await serve_generation(request, ChatCompletionRequest, _plan)


async def _plan(state: AppState, req: ChatCompletionRequest, tokens: TokenizerService) -> Plan:
    try:
        tools = ToolPlan.of(req.tools, req.tool_choice, state.architecture, req.parallel_tool_calls)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from exc
    prompt = await tokens.chat_prompt([m.for_template() for m in req.messages], tools.template_tools())
    prompt_ids = prompt.input_ids
    max_new = check_context(len(prompt_ids), req.requested_max_tokens, state.context_len, unit="messages")
    params = sampling_params(req, max_new)
    params = with_constraint(params, req.response_format.constraint() if req.response_format else None)
    params = with_constraint(params, tools.constraint(), "tool_choice")
    group_id = new_id("chatcmpl")
    boots = req.bootstraps(1, req.n)
    priority = request_priority(req.priority)
    choices = [
        Choice(i, group_id if req.n == 1 else f"{group_id}-{i}", prompt_ids, for_choice(params, i), boots[i], priority=priority,
               answer_spans=prompt.answer_spans)
        for i in range(req.n)
    ]
    return Plan(
        group_id, choices, lambda group: _ChatView(state, req, group, tokens, tools),
        return_logprob=req.logprobs, top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
    )


class _ChatView:
    """Renders one chat request's group as OpenAI chat objects."""

    def __init__(
        self, state: AppState, req: ChatCompletionRequest, group: GenerationGroup, tokens: TokenizerService, tools: ToolPlan
    ) -> None:
        self.req = req
        self.tools = tools
        self.sent: dict[int, int] = {}  # choice index -> characters of its text sent as content
        self.group = group
        self.tokens = tokens
        self.created = now()
        self.model = state.model_name

    def _head(self, obj: str) -> Payload:
        return {"id": self.group.id, "object": obj, "created": self.created, "model": self.model, "system_fingerprint": None}

    def final(self) -> Payload:
        out = []
        for choice in self.group.choices:
            lp = chat_logprobs(self.tokens, choice.token_logprobs, choice.top_logprobs) if self.req.logprobs else None
            content, calls = self.tools.parse(choice.text)
            message: Payload = {"role": "assistant", "content": content}
            reason = finish_reason(choice.final_meta()) or "abort"
            if calls:
                message["tool_calls"] = [c.to_json() for c in calls]
                reason = "tool_calls" if reason == "stop" else reason
            out.append({"index": choice.index, "message": message, "logprobs": lp, "finish_reason": reason})
        return {**self._head("chat.completion"), "choices": out, "usage": usage(self.group.choices, self.req.n)}

    def _chunk(self, index: int, delta: Payload, logprobs: Payload | None, reason: str | None) -> Payload:
        chunk = {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}],
        }
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def stream(self) -> AsyncIterator[Payload]:
        for choice in self.group.choices:
            yield self._chunk(choice.index, {"role": "assistant", "content": ""}, None, None)
        async for index, chunk in self.group.events():
            meta = chunk["meta_info"]
            reason = finish_reason(meta)
            sampled, tops = new_logprobs(meta)
            lp = chat_logprobs(self.tokens, sampled, tops) if self.req.logprobs and sampled else None
            if reason is not None and self.tools.mode != "none":
                _, calls = self.tools.parse(self.group.choices[index].text)
                if calls:  # sent whole at the end, when their arguments are complete JSON
                    deltas = [c.to_json(i) for i, c in enumerate(calls)]
                    yield self._chunk(index, {"tool_calls": deltas}, lp, "tool_calls" if reason == "stop" else reason)
                    continue
            text = self._content_delta(index, reason is not None)
            if text or reason is not None or lp is not None:
                yield self._chunk(index, {"content": text} if text else {}, lp, reason)
        if self.req.include_usage:
            yield {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(self.group.choices, self.req.n)}

    def _content_delta(self, index: int, final: bool) -> str:
        """The content not yet sent of choice `index` that may go out now: all of it at the
        end (no call parsed), before that nothing of a forced call and, in auto mode, not
        what may be the start of one."""
        text = self.group.choices[index].text
        end = len(text) if final else self.tools.holds_back(text)
        start = self.sent.get(index, 0)
        if end <= start:
            return ""
        self.sent[index] = end
        return text[start:end]

