"""Engine output -> OpenAI response fields (finish_reason, usage, logprobs).

Engine chunks carry cumulative logprob lists; each formatter takes a start
position so a stream sends every token's logprob exactly once.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from app.generation import Choice
from app.tokens import TokenizerService


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(chunk: dict[str, Any]) -> str | None:
    reason = (chunk.get("meta_info") or {}).get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return kind if kind in ("stop", "length", "abort") else "stop"


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice); completion tokens per choice.
    A prompt's cached tokens are the most any of its choices got from the prefix cache."""
    prompt_tokens = completion_tokens = cached_tokens = 0
    for start in range(0, len(choices), n):
        group = choices[start : start + n]
        metas = [c.final().get("meta_info") or {} for c in group]
        prompt_tokens += int(metas[0].get("prompt_tokens") or len(group[0].prompt_ids))
        cached_tokens += max(int(m.get("cached_tokens") or 0) for m in metas)
        completion_tokens += sum(int(m.get("completion_tokens") or 0) for m in metas)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _logprob_lists(chunk: dict[str, Any], start: int) -> tuple[list[Any], list[Any]]:
    meta = chunk.get("meta_info") or {}
    sampled = list(meta.get("output_token_logprobs") or [])[start:]
    tops = list(meta.get("output_top_logprobs") or [])[start:]
    return sampled, tops


def logprob_count(chunk: dict[str, Any]) -> int:
    return len((chunk.get("meta_info") or {}).get("output_token_logprobs") or [])


def completion_logprobs(
    tokens: TokenizerService,
    chunk: dict[str, Any],
    start: int,
    text_offset: int,
    prompt_ids: list[int] | None = None,
) -> tuple[dict[str, Any], int]:
    """OpenAI completions `logprobs` for output tokens from `start` (and, with echo, the
    prompt's tokens first, whose logprobs the engine does not compute: null).
    Returns the object and the text offset after its last token."""
    texts: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    for token_id in prompt_ids or []:
        texts.append(tokens.token_text(token_id))
        token_logprobs.append(None)
        top_logprobs.append(None)
    sampled, tops = _logprob_lists(chunk, start)
    for i, (logprob, token_id) in enumerate(sampled):
        text = tokens.token_text(int(token_id))
        texts.append(text)
        token_logprobs.append(float(logprob))
        entry = {tokens.token_text(int(t)): float(lp) for lp, t in (tops[i] if i < len(tops) and tops[i] else [])}
        entry.setdefault(text, float(logprob))
        top_logprobs.append(entry)
    offsets: list[int] = []
    for text in texts:
        offsets.append(text_offset)
        text_offset += len(text)
    obj = {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return obj, text_offset


def _chat_entry(tokens: TokenizerService, logprob: float, token_id: int) -> dict[str, Any]:
    text = tokens.token_text(int(token_id))
    return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokens: TokenizerService, chunk: dict[str, Any], start: int) -> dict[str, Any]:
    """OpenAI chat `logprobs` ({"content": [...]}) for output tokens from `start`."""
    sampled, tops = _logprob_lists(chunk, start)
    content = []
    for i, (logprob, token_id) in enumerate(sampled):
        entry = _chat_entry(tokens, logprob, token_id)
        top = tops[i] if i < len(tops) and tops[i] else []
        entry["top_logprobs"] = [_chat_entry(tokens, lp, t) for lp, t in top]
        content.append(entry)
    return {"content": content, "refusal": None}
