"""One caller's request -> a `Req`, or an `InvalidRequest` before anything is queued
(the checks SGLang's TokenizerManager makes in `_validate_one_request`, and the
scheduler's own on `logprob_start_len`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.errors import InvalidRequest
from runtime.managers.embedding_manager import EMBEDDING, EmbeddingParams, EmbeddingReq
from runtime.managers.io_struct import BootstrapInfo
from runtime.managers.req import Req
from runtime.sampling_params import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRIORITY, MAX_TOP_LOGPROBS, SamplingParams, check_priority
from runtime.token_roles import TokenPrompt

SamplingInput = SamplingParams | dict[str, Any] | None  # a dict uses SamplingParams' field names


@dataclass(frozen=True, slots=True)
class RequestLimits:
    context_len: int  # prompt + output tokens the model takes
    vocab_size: int
    kv_tokens: int  # prompt + output tokens one request may hold in the KV pool
    eos_token_ids: tuple[int, ...]
    device: torch.device
    is_embedding: bool = False  # an --is-embedding server takes embedding requests only
    disaggregation_mode: str = "null"  # "prefill" | "decode": no prompt logprobs, no prefill-only requests
    needs_bootstrap: bool = False  # requests must say where their KV goes or comes from
    grammars: bool = True  # a grammar backend compiles json_schema / regex / ebnf
    refuses_priority: bool = False  # --abort-on-priority-when-disabled on a server not scheduling by priority


@dataclass(frozen=True, slots=True)
class LogprobOptions:
    """What a request asks of logprobs, under SGLang's names."""

    return_logprob: bool = False
    top_logprobs_num: int = 0  # top alternatives per token (output, and prompt ones)
    # -1: output tokens only; s >= 0: prompt tokens [s, n) too (the first entry is None):
    # meta_info's input_token_logprobs. Ignored without return_logprob / top_logprobs_num.
    logprob_start_len: int = -1


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


def _check_ids(ids: list[int], limits: RequestLimits) -> None:
    if not ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab_size for t in ids):
        raise InvalidRequest(f"token ids must be integers in [0, {limits.vocab_size})", param="prompt")


def make_embedding_req(ids: list[int], params: SamplingInput, rid: str, limits: RequestLimits) -> EmbeddingReq:
    """An embedding request (params `EMBEDDING`) for an --is-embedding server; either
    kind of request on the other kind of server is refused."""
    if not limits.is_embedding:
        raise InvalidRequest("This server runs a generation model: embeddings need a server started with "
                             "--is-embedding.", param="input")
    if not isinstance(params, EmbeddingParams):
        raise InvalidRequest("This server runs an embedding model (--is-embedding): it serves /v1/embeddings "
                             "and /encode, not generation.", param="model")
    _check_ids(ids, limits)
    n = len(ids)
    if n >= limits.context_len:  # SGLang's bound: one position stays free, as for a prompt
        raise InvalidRequest(f"The input ({n} tokens) is longer than the model's context length "
                             f"({limits.context_len} tokens).", param="input")
    if n + EMBEDDING.max_new_tokens > limits.kv_tokens:  # (admission reserves that one step)
        raise InvalidRequest(f"The input ({n} tokens) does not fit the KV cache ({limits.kv_tokens} tokens for one "
                             "request).", param="input")
    return EmbeddingReq(rid, ids)


def make_req(
    prompt: TokenPrompt, params: SamplingInput, rid: str, logprobs: LogprobOptions, limits: RequestLimits,
    bootstrap: BootstrapInfo | None = None, priority: int | None = None,
) -> Req:
    if bootstrap is None and limits.needs_bootstrap:
        raise InvalidRequest(
            f"this is a {limits.disaggregation_mode} server: requests need bootstrap_host, bootstrap_port "
            "and bootstrap_room (send them through sglang-router --pd-disaggregation)", param="bootstrap_room")
    ids = prompt.input_ids
    if limits.is_embedding or isinstance(params, EmbeddingParams):
        embedding = make_embedding_req(ids, params, rid, limits)
        embedding.bootstrap = bootstrap
        return embedding
    ctx, n = limits.context_len, len(ids)
    _check_ids(ids, limits)
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
    if sp.grammar is not None and not limits.grammars:
        kind = sp.grammar[0]
        raise InvalidRequest(f"{kind} needs structured output: this server runs --grammar-backend none", param=kind)
    top = logprobs.top_logprobs_num
    if not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs_num must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    if priority is not None and limits.refuses_priority:
        raise InvalidRequest("this server does not schedule by priority (--abort-on-priority-when-disabled): "
                             "send the request without one", param="priority")
    prio = DEFAULT_PRIORITY if priority is None else check_priority(priority)
    want = logprobs.return_logprob or top > 0
    start = logprob_start_len(logprobs.logprob_start_len if want else -1, n, sp.max_new_tokens, limits)
    if (why := prompt.check()) is not None:
        raise InvalidRequest(why, param="answer_spans")
    req = Req(rid, ids, sp, limits.eos_token_ids, want, top, prio, logprob_start_len=start, answer_spans=prompt.answer_spans)
    req.bootstrap = bootstrap
    if sp.seed is not None and not sp.is_greedy:
        req.generator = torch.Generator(device=limits.device).manual_seed(sp.seed)
    return req


def logprob_start_len(start: int, prompt_len: int, max_new_tokens: int, limits: RequestLimits) -> int:
    """The checked `logprob_start_len`: -1, or a prompt position (SGLang refuses one past the
    prompt's last token). A prefill/decode server computes neither prompt logprobs nor
    prefill-only requests: its prefill half's output never reaches the caller."""
    if isinstance(start, bool) or not isinstance(start, int) or not -1 <= start < prompt_len:
        raise InvalidRequest(f"logprob_start_len must be -1 (output tokens only) or a prompt position in "
                             f"[0, {prompt_len}) (the prompt has {prompt_len} tokens); got {start!r}",
                             param="logprob_start_len")
    if limits.disaggregation_mode != "null" and (start >= 0 or max_new_tokens == 0):
        param = "logprob_start_len" if start >= 0 else "max_new_tokens"
        raise InvalidRequest(f"prompt logprobs and max_new_tokens=0 are not supported on a {limits.disaggregation_mode} "
                             "server (prefill/decode disaggregation)", param=param)
    return start
