"""Request schemas of the OpenAI-compatible routes, and what every route's schema shares.

Validation here is about shape only: strict JSON types (`"5"` is not an int), finite
floats, message roles and content. A sampling param's bounds and meaning are declared
once, in `runtime.sampling_params.PARAM_SPECS`: a field marked `EngineParam(name)`
takes its documentation and JSON-schema bounds from there, and `app.sampling` hands
its value to `SamplingParams.from_dict`, which enforces them. Unknown fields are
ignored (OpenAI's SDKs send extras) and a field sent as `null` counts as not given.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from typing import Annotated, Literal, TypeVar, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, GetJsonSchemaHandler, ValidationInfo, field_validator, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from app.errors import APIError
from runtime.managers.io_struct import BootstrapInfo
from runtime.sampling_params import INT32_MAX, MAX_TOP_LOGPROBS, PARAM_SPECS, REQUEST_SPECS, ParamSpec

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n in one request
MAX_LOGPROBS = MAX_TOP_LOGPROBS
T = TypeVar("T")


def _utf8(value: str) -> str:
    value.encode("utf-8")  # raises on lone surrogates, which no tokenizer accepts
    return value


Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Stop = NonEmptyText | list[NonEmptyText]
Port = Annotated[int, Field(ge=1, le=65535)]
Room = Annotated[int, Field(ge=0, le=(1 << 64) - 1)]


@dataclass(frozen=True, slots=True)
class EngineParam:
    """Marks a request field as the SamplingParams field `name` (under the route's own
    name, e.g. `max_tokens`). Its schema documents PARAM_SPECS[name]; its value is
    validated by SamplingParams when the app builds the params."""

    name: str
    note: str = ""  # what this route adds, e.g. its default

    def __get_pydantic_json_schema__(self, core: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return _documented(handler(core), PARAM_SPECS[self.name], self.note)


@dataclass(frozen=True, slots=True)
class RequestParam:
    """Marks a request-level field that is no sampling param (`priority`): its schema
    documents REQUEST_SPECS[name], and the app checks its value with the engine's check."""

    name: str

    def __get_pydantic_json_schema__(self, core: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return _documented(handler(core), REQUEST_SPECS[self.name], "")


def _documented(schema: JsonSchemaValue, spec: ParamSpec, note: str) -> JsonSchemaValue:
    """`schema` with `spec`'s bounds on its numbers (each item's, for a list) and its doc."""
    for branch in schema.get("anyOf", [schema]):
        target = branch.get("items", {}) if branch.get("type") == "array" else branch
        if target.get("type") in ("integer", "number"):
            target.update(spec.json_schema())
    schema["description"] = f"{spec.doc} {note}".strip()
    return schema


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: object) -> object:
        # OpenAI treats `"field": null` as the field's absence; so do all routes.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class SamplingKnobs(Strict):
    """Sampling params every route names as SamplingParams does (None = the engine default)."""

    temperature: Annotated[float | None, EngineParam("temperature")] = None
    top_p: Annotated[float | None, EngineParam("top_p")] = None
    top_k: Annotated[int | None, EngineParam("top_k")] = None
    min_p: Annotated[float | None, EngineParam("min_p")] = None
    frequency_penalty: Annotated[float | None, EngineParam("frequency_penalty")] = None
    presence_penalty: Annotated[float | None, EngineParam("presence_penalty")] = None
    repetition_penalty: Annotated[float | None, EngineParam("repetition_penalty")] = None
    seed: Annotated[int | None, EngineParam("seed")] = None
    stop: Annotated[Stop | None, EngineParam("stop")] = None
    stop_token_ids: Annotated[list[int] | None, EngineParam("stop_token_ids")] = None
    ignore_eos: Annotated[bool | None, EngineParam("ignore_eos")] = None
    skip_special_tokens: Annotated[bool | None, EngineParam("skip_special_tokens")] = None
    spaces_between_special_tokens: Annotated[bool | None, EngineParam("spaces_between_special_tokens")] = None
    logit_bias: Annotated[dict[str, float] | None, EngineParam("logit_bias", "Keys are token ids (as strings).")] = None
    json_schema: Annotated[NonEmptyText | None, EngineParam("json_schema")] = None
    regex: Annotated[NonEmptyText | None, EngineParam("regex")] = None
    ebnf: Annotated[NonEmptyText | None, EngineParam("ebnf")] = None


class GenerationBody(Strict):
    """What the generation routes' bodies share."""

    stream: bool = False
    return_trace: bool = Field(False, description="Add each request's timeline to its last output's meta_info.trace.")
    # Prefill/decode disaggregation, as sglang-router --pd-disaggregation injects them:
    # one value for the request, or one per prompt, or one per choice (prompt-major).
    bootstrap_host: NonEmptyText | list[NonEmptyText] | None = None
    bootstrap_port: Port | list[Port] | None = None
    bootstrap_room: Room | list[Room] | None = None

    @model_validator(mode="after")
    def _bootstrap_together(self) -> GenerationBody:
        given = [f is not None for f in (self.bootstrap_host, self.bootstrap_port, self.bootstrap_room)]
        if any(given) and not all(given):
            raise ValueError("bootstrap_host, bootstrap_port and bootstrap_room must be given together")
        return self

    def bootstraps(self, num_prompts: int, n: int) -> list[BootstrapInfo | None]:
        """One BootstrapInfo per choice, prompt-major. Given once or once per prompt, choice
        i of that group gets room + i (SGLang's expansion of parallel sampling); both
        servers expand alike, so the two halves of every choice still pair."""
        total = num_prompts * n
        if self.bootstrap_host is None or self.bootstrap_port is None or self.bootstrap_room is None:
            return [None] * total
        hosts = _per_choice("bootstrap_host", self.bootstrap_host, num_prompts, n, shift=False)
        ports = _per_choice("bootstrap_port", self.bootstrap_port, num_prompts, n, shift=False)
        rooms = _per_choice("bootstrap_room", self.bootstrap_room, num_prompts, n, shift=True)
        return [BootstrapInfo(h, p, r) for h, p, r in zip(hosts, ports, rooms)]

    def requested_model(self) -> str | None:
        """The model the body names, checked against the served one (None: not named)."""
        return None


def _per_choice(name: str, value: T | list[T], num_prompts: int, n: int, *, shift: bool) -> list[T]:
    values = value if isinstance(value, list) else [value]
    total = num_prompts * n
    if len(values) == total:
        return list(values)
    if len(values) == 1:
        group = total  # one value for every choice of every prompt
    elif len(values) == num_prompts:
        group = n
    else:
        raise APIError(400, f"{name} has {len(values)} entries for {num_prompts} prompt(s) x n={n}", param=name)
    out = [values[i // group] for i in range(total)]
    if shift:
        out = [cast(T, (cast(int, v) + i % group) % (1 << 64)) for i, v in enumerate(out)]
    return out


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(SamplingKnobs, GenerationBody):
    """What both OpenAI routes take besides their prompt (OpenAI names plus vLLM's extras)."""

    n: int = Field(1, ge=1, le=MAX_N)
    priority: Annotated[int | None, RequestParam("priority")] = None  # vLLM's and SGLang's extra, for every choice
    min_tokens: Annotated[int | None, EngineParam("min_new_tokens")] = None
    include_stop_str_in_output: Annotated[bool | None, EngineParam("no_stop_trim")] = None
    stream_options: StreamOptions | None = None
    user: Text | None = None
    model: Text | None = Field(None, description="Must be the served model name when given.")

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def requested_model(self) -> str | None:
        return self.model

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1)
    ]
    max_tokens: Annotated[int, EngineParam("max_new_tokens", "Default 16.")] = 16
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


class MessageFunctionCall(Strict):
    name: Text
    arguments: Text  # JSON text


class MessageToolCall(Strict):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: Text | None = None
    # Required for every role but an assistant turn that made tool calls (as OpenAI).
    # Declared after tool_calls: its validator reads them.
    content: Text | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content", mode="after")
    @classmethod
    def _content_or_calls(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        if content is None and not info.data.get("tool_calls"):
            raise ValueError("content is required (an assistant message may give tool_calls instead)")
        return content

    @model_validator(mode="after")
    def _calls_from_the_assistant(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def for_template(self) -> dict[str, object]:
        """The message as chat templates expect it: text parts joined by newlines, tool
        call arguments as objects."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, object] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]
        return message


def _json_or_text(text: str) -> object:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


class JSONSchemaFormat(Strict):
    model_config = Strict.model_config | {"populate_by_name": True}

    name: Text = "response"
    schema_: dict[str, object] | None = Field(None, alias="schema", description="Default: any JSON object.")
    description: Text | None = None
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self

    def constraint(self) -> str | None:
        """The JSON schema (as JSON text) the output must follow, or None for text."""
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        return orjson.dumps(schema if schema is not None else {"type": "object"}).decode()


class FunctionDef(Strict):
    name: Text = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Text | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: Text


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice




class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int | None, EngineParam("max_new_tokens", "Default: up to the context length.")] = None
    max_completion_tokens: Annotated[int | None, EngineParam("max_new_tokens", "Alias of max_tokens.")] = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = Field(None, description="Default: auto with tools, none without.")
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if self.tools and self.response_format is not None and self.response_format.type != "text":
            if self.tool_choice not in (None, "none"):
                raise ValueError("response_format cannot be combined with tool calls")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
