"""OpenAI request fields -> the engine's sampling params (SGLang names)."""

from __future__ import annotations

from typing import Any

from app.errors import APIError
from app.protocol import INT64_MAX, INT64_MIN, SamplingFields


def openai_sampling_params(req: SamplingFields, max_new_tokens: int) -> dict[str, Any]:
    """The params every choice of `req` shares; `seed` is added per choice by `for_choice`."""
    if req.min_tokens > max_new_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_new_tokens}).", param="min_tokens")
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if req.min_tokens:
        params["min_new_tokens"] = req.min_tokens
    # temperature 0 is passed through: the engine samples greedily at 0.
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if req.top_k is not None:
        params["top_k"] = -1 if req.top_k == 0 else req.top_k
    if req.stop:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids:
        params["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        params["ignore_eos"] = True
    if not req.skip_special_tokens:
        params["skip_special_tokens"] = False
    if not req.spaces_between_special_tokens:
        params["spaces_between_special_tokens"] = False
    if req.include_stop_str_in_output:
        params["no_stop_trim"] = True
    return params


def for_choice(params: dict[str, Any], seed: int | None, index: int) -> dict[str, Any]:
    """Choice `index` of a seeded request samples with `seed + index` (wrapped to int64),
    so the n choices differ from each other yet the whole response is reproducible."""
    if seed is None:
        return params
    span = INT64_MAX - INT64_MIN + 1
    return {**params, "seed": (seed + index - INT64_MIN) % span + INT64_MIN}
