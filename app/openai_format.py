"""Engine output -> OpenAI response fields (finish_reason, usage, logprobs).

The logprob formatters take the (logprob, token_id) lists of some output tokens: a
stream passes each delta chunk's, a final body its choice's whole lists.
"""

from __future__ import annotations

import time
import uuid
from typing import NamedTuple

from app.generation import Choice
from app.responses import Payload
from app.tokens import TokenizerService
from runtime.managers.io_struct import MetaInfo, PromptTokenLogprob, TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(meta: MetaInfo) -> str | None:
    reason = meta["finish_reason"]
    if reason is None:
        return None
    return reason["type"] if reason["type"] in ("stop", "length", "abort") else "stop"


def usage(choices: list[Choice], n: int) -> Payload:
    """Prompt tokens count once per prompt (not per choice); completion tokens per choice.
    A prompt's cached tokens are the most any of its choices got from the prefix cache."""
    prompt_tokens = completion_tokens = cached_tokens = 0
    for start in range(0, len(choices), n):
        metas = [c.final_meta() for c in choices[start : start + n]]
        prompt_tokens += metas[0]["prompt_tokens"]
        cached_tokens += max(m["cached_tokens"] for m in metas)
        completion_tokens += sum(m["completion_tokens"] for m in metas)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def new_logprobs(meta: MetaInfo) -> tuple[list[TokenLogprob], list[list[TokenLogprob]]]:
    """A delta chunk's sampled and top logprobs (empty when not requested)."""
    return meta.get("output_token_logprobs", []), meta.get("output_top_logprobs", [])


class EchoedPrompt(NamedTuple):
    """An echoed prompt and what the engine computed of its logprobs (empty if nothing)."""

    ids: list[int]
    logprobs: list[PromptTokenLogprob]  # (None, first token), then (logprob, token) per token
    tops: list[list[TokenLogprob] | None]  # with top_logprobs_num > 0: None, then each token's


def completion_logprobs(
    tokens: TokenizerService,
    sampled: list[TokenLogprob],
    tops: list[list[TokenLogprob]],
    text_offset: int,
    prompt: EchoedPrompt | None = None,
) -> tuple[Payload, int]:
    """OpenAI completions `logprobs` for these output tokens (and, with echo, the prompt's
    tokens first: null for the first one, as OpenAI and vLLM report it, and for any the
    engine did not score), the first starting at `text_offset`. Returns the object and the
    text offset after its last token."""
    texts: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []

    def add(token_id: int, logprob: float | None, top: list[TokenLogprob] | None) -> None:
        text = tokens.token_text(int(token_id))
        texts.append(text)
        token_logprobs.append(None if logprob is None else float(logprob))
        if logprob is None:
            top_logprobs.append(None)
            return
        entry = {tokens.token_text(int(t)): float(lp) for lp, t in top or []}
        entry.setdefault(text, float(logprob))
        top_logprobs.append(entry)

    if prompt is not None:
        scored = len(prompt.logprobs) == len(prompt.ids)
        for j, token_id in enumerate(prompt.ids):
            add(token_id, prompt.logprobs[j][0] if scored else None, prompt.tops[j] if j < len(prompt.tops) else None)
    for i, (logprob, token_id) in enumerate(sampled):
        add(token_id, logprob, tops[i] if i < len(tops) else None)
    offsets: list[int] = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    obj: Payload = {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return obj, text_offset


def _chat_entry(tokens: TokenizerService, logprob: float, token_id: int) -> Payload:
    text = tokens.token_text(int(token_id))
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: TokenizerService, sampled: list[TokenLogprob], tops: list[list[TokenLogprob]]) -> Payload:
    """OpenAI chat `logprobs` ({"content": [...]}) for these output tokens."""
    content = []
    for i, (logprob, token_id) in enumerate(sampled):
        entry = _chat_entry(tokens, logprob, token_id)
        top = tops[i] if i < len(tops) and tops[i] else []
        entry["top_logprobs"] = [_chat_entry(tokens, lp, t) for lp, t in top]
        content.append(entry)
    return {"content": content, "refusal": None}
