"""Request schemas of the native (SGLang-style) routes.

`SamplingParams` mirrors the engine's sampling params (SGLang names) and forbids
unknown keys, so nothing the engine would choke on reaches it.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from app.protocol import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    ChatMessage,
    NonEmptyText,
    Stop,
    Strict,
    Text,
    TokenId,
    TokenIds,
)

Rid = Annotated[str, Field(min_length=1, max_length=256)]


class SamplingParams(Strict):
    model_config = Strict.model_config | {"extra": "forbid"}

    max_new_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    min_new_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0 = greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)

    def to_engine(self) -> dict[str, object]:
        """Only the knobs that were set; the engine fills in its defaults."""
        params = self.model_dump(exclude_none=True)
        if params.get("top_k") == 0:
            params["top_k"] = -1
        return params


class GenerateRequest(Strict):
    text: NonEmptyText | None = None
    input_ids: TokenIds | None = None
    sampling_params: SamplingParams | None = None
    stream: bool = False
    rid: Rid | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids is required")
        return self


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
