"""Request schemas of the OpenAI-compatible routes (pydantic, strict JSON types).

These models are the single source of validation for `/v1/completions` and
`/v1/chat/completions` and of the app's OpenAPI document. Validation is strict
(`"5"` is not an int), unknown fields are ignored as OpenAI's SDKs send extras,
and every float must be finite. Cross-field rules that need the tokenizer (prompt
+ max_tokens over the context length) live in the handlers.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n in one request
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1  # bound of token ids and top_k: larger values only overflow tensors


def _utf8(value: str) -> str:
    value.encode("utf-8")  # raises on lone surrogates, which no tokenizer accepts
    return value


Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Stop = NonEmptyText | list[NonEmptyText]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Sampling knobs shared by both OpenAI routes (OpenAI names plus vLLM's extras)."""

    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="-1 or 0 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    model: Text | None = Field(None, description="Must be the served model name when given.")

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self


class CompletionRequest(SamplingFields):
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1)
    ]
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX, description="Default 16.")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (server-side best-of is not supported)")
        if self.num_prompts * self.n > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} choices (prompts x n) per request")
        return self

    @property
    def num_prompts(self) -> int:
        if isinstance(self.prompt, str):
            return 1
        return len(self.prompt) if isinstance(self.prompt[0], str | list) else 1

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt, each a string or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def for_template(self) -> dict[str, str]:
        """The message as chat templates expect it: text parts joined by newlines."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ResponseFormat(Strict):
    type: Literal["text"] = Field(description="Only plain text output is supported.")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Default: up to the context length.")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Alias of max_tokens.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, object]] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
