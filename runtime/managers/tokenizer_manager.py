"""One caller's request -> a `Req`, or an `InvalidRequest` before anything is queued
(the checks SGLang's TokenizerManager makes in `_validate_one_request`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.errors import InvalidRequest
from runtime.managers.req import Req
from runtime.sampling_params import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRIORITY, MAX_TOP_LOGPROBS, SamplingParams, check_priority

SamplingInput = SamplingParams | dict[str, Any] | None  # a dict uses SamplingParams' field names


@dataclass(frozen=True, slots=True)
class RequestLimits:
    context_len: int  # prompt + output tokens the model takes
    vocab_size: int
    kv_tokens: int  # prompt + output tokens one request may hold in the KV pool
    eos_token_ids: tuple[int, ...]
    device: torch.device
    refuses_priority: bool = False  # --abort-on-priority-when-disabled on a server not scheduling by priority


def sampling_params(params: SamplingInput, room: int) -> SamplingParams:
    """Validated params; a dict without max_new_tokens gets DEFAULT_MAX_NEW_TOKENS, cut to
    the `room` the context leaves. A SamplingParams is validated and used as given."""
    if isinstance(params, SamplingParams):
        params.validate()
        return params
    if params is not None and not isinstance(params, dict):
        raise InvalidRequest("sampling_params must be a dict or a SamplingParams", param="sampling_params")
    values = dict(params or {})
    if values.get("max_new_tokens") is None:
        values["max_new_tokens"] = min(DEFAULT_MAX_NEW_TOKENS, room)
    return SamplingParams.from_dict(values)


def make_req(
    ids: list[int], params: SamplingInput, rid: str, return_logprob: bool, top_logprobs_num: int, limits: RequestLimits,
    priority: int | None = None,
) -> Req:
    ctx, n = limits.context_len, len(ids)
    if not ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab_size for t in ids):
        raise InvalidRequest(f"token ids must be integers in [0, {limits.vocab_size})", param="prompt")
    if n >= ctx:
        raise InvalidRequest(f"This model's maximum context length is {ctx} tokens. However, the prompt has {n} "
                             "tokens, which leaves no room for the completion.", param="prompt")
    sp = sampling_params(params, ctx - n)
    if n + sp.max_new_tokens > ctx:
        raise InvalidRequest(f"This model's maximum context length is {ctx} tokens. However, you requested "
                             f"{n + sp.max_new_tokens} tokens ({n} in the prompt, {sp.max_new_tokens} for the "
                             "completion).", param="max_tokens")
    if n + sp.max_new_tokens > limits.kv_tokens:
        raise InvalidRequest(f"prompt ({n}) + max_new_tokens ({sp.max_new_tokens}) exceeds the KV cache "
                             f"({limits.kv_tokens} tokens for one request)", param="max_tokens")
    if sp.logit_bias and max(sp.logit_bias) >= limits.vocab_size:
        raise InvalidRequest(f"logit_bias token ids must be in [0, {limits.vocab_size})", param="logit_bias")
    if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    if priority is not None and limits.refuses_priority:
        raise InvalidRequest("this server does not schedule by priority (--abort-on-priority-when-disabled): "
                             "send the request without one", param="priority")
    prio = DEFAULT_PRIORITY if priority is None else check_priority(priority)
    req = Req(rid, ids, sp, limits.eos_token_ids, return_logprob or top_logprobs_num > 0, top_logprobs_num, prio)
    if sp.seed is not None and not sp.is_greedy:
        req.generator = torch.Generator(device=limits.device).manual_seed(sp.seed)
    return req
