"""Request schemas of the native (SGLang-style) routes.

`SamplingParamsBody` is `runtime.SamplingParams` as JSON: the same field names (a
test holds the two sets equal), documented and bounded by PARAM_SPECS through
`EngineParam`, with unknown keys refused so nothing the engine would choke on reaches it.
"""

from __future__ import annotations

from typing import Annotated, cast

from pydantic import Field, field_validator, model_validator

from app.protocol import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    ChatMessage,
    EngineParam,
    GenerationBody,
    NonEmptyText,
    RequestParam,
    SamplingKnobs,
    Strict,
    Text,
    TokenId,
    TokenIds,
)
from runtime.token_roles import Span

Rid = Annotated[str, Field(min_length=1, max_length=256)]
SpanBody = Annotated[list[int], Field(min_length=2, max_length=2)]  # [start, end)


class SamplingParamsBody(SamplingKnobs):
    model_config = SamplingKnobs.model_config | {"extra": "forbid"}

    max_new_tokens: Annotated[int | None, EngineParam("max_new_tokens", "Default: 128, cut to the context left.")] = None
    min_new_tokens: Annotated[int | None, EngineParam("min_new_tokens")] = None
    no_stop_trim: Annotated[bool | None, EngineParam("no_stop_trim")] = None


class GenerateRequest(GenerationBody):
    """One prompt, or a batch: a list of texts or of token-id lists (then sampling_params,
    rid and priority may be lists too, one per prompt), answered with a list."""

    text: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    rid: Rid | list[Rid] | None = None
    priority: Annotated[int | list[int] | None, RequestParam("priority")] = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)
    logprob_start_len: int | list[int] = Field(-1, description=(
        "With return_logprob: -1 = output tokens only; s >= 0 = also the prompt's tokens from position s on "
        "(meta_info.input_token_logprobs, whose first entry has logprob null). Must be below the prompt's length."))
    return_text_in_logprobs: bool = Field(False, description="Fill each logprob entry's third element with its token's text.")
    answer_spans: list[SpanBody] | list[list[SpanBody]] | None = Field(None, description=(
        "With input_ids (sluice): the [start, end) positions of earlier answers of the model in the prompt (a "
        "conversation's assistant turns), sorted and disjoint; a batch gives one list per prompt. Under "
        "deterministic inference an earlier answer's KV is then served from the turn that wrote it."))

    @field_validator("logprob_start_len")
    @classmethod
    def _start_or_minus_one(cls, value: int | list[int]) -> int | list[int]:
        if any(s < -1 for s in (value if isinstance(value, list) else [value])):
            raise ValueError("must be -1 (output tokens only) or a prompt position >= 0")
        return value

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids is required")
        n = len(self.prompts())
        for name in ("sampling_params", "rid", "logprob_start_len", "priority"):
            value = getattr(self, name)
            if isinstance(value, list) and (not self.batched or len(value) != n):
                raise ValueError(f"a list of {name} needs a batch of as many prompts ({n})")
        spans = self.answer_spans
        if spans is not None:
            per_prompt = any(len(x) != 2 or not all(isinstance(v, int) for v in x) for x in spans)  # span lists, not spans
            if self.input_ids is None or per_prompt != self.batched or (per_prompt and len(spans) != n):
                raise ValueError(f"answer_spans needs input_ids: one list of [start, end] pairs, or in a batch one per prompt ({n})")
        return self

    def spans(self) -> list[tuple[Span, ...]]:
        """The answer spans of each prompt (none given: empty)."""
        if self.answer_spans is None:
            return [()] * len(self.prompts())
        each = cast(list[list[list[int]]], self.answer_spans) if self.batched else [cast(list[list[int]], self.answer_spans)]
        return [tuple((a, b) for a, b in spans) for spans in each]

    @property
    def batched(self) -> bool:
        return isinstance(self.text, list) or (isinstance(self.input_ids, list) and isinstance(self.input_ids[0], list))

    def prompts(self) -> list[str | list[int]]:
        if self.text is not None:
            return list(self.text) if isinstance(self.text, list) else [self.text]
        assert self.input_ids is not None
        if self.batched:
            return [list(p) for p in cast(list[list[int]], self.input_ids)]
        return [list(cast(list[int], self.input_ids))]


class TokenizeRequest(Strict):
    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(
        None, description="Default: true for prompt, false for messages (the template adds them)."
    )

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages is required")
        return self


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[TokenId]


class AbortRequest(Strict):
    rid: Rid | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> AbortRequest:
        if self.rid is None and not self.abort_all:
            raise ValueError("give rid or abort_all: true")
        return self
