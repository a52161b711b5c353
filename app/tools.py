"""Chat tool calls: the request schema, how each tool_choice constrains the output, and
the parsers that read tool calls out of a model's text.

tool_choice `none`: plain text. A named function: the output is constrained to that
function's parameters schema, so it *is* the call's arguments (works with any model).
`required`: the output is constrained to a JSON array of {"name", "parameters"} objects
naming the given functions. `auto`: free text, read by the parser of the model's chat
format: Qwen2/Qwen3's `<tool_call>{"name", "arguments"}</tool_call>` blocks, or Llama-3's
bare JSON `{"name", "parameters"}` (optionally after `<|python_tag|>`).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Literal

import json

import orjson

from app.protocol import NamedToolChoice, Tool, ToolChoice

QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def to_json(self, index: int | None = None) -> dict[str, object]:
        call: dict[str, object] = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call(name: str, arguments: object) -> ToolCall:
    text = arguments if isinstance(arguments, str) else orjson.dumps(arguments if arguments is not None else {}).decode()
    return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools do to its generation and how its text is read."""

    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[Tool, ...]
    parser: Literal["qwen", "llama3"]
    named: str | None = None

    @staticmethod
    def of(tools: list[Tool] | None, choice: ToolChoice | None, architecture: str, parallel: bool) -> ToolPlan:
        parser: Literal["qwen", "llama3"] = "qwen" if architecture.startswith("Qwen") else "llama3"
        if not tools or choice == "none":
            return ToolPlan("none", tuple(tools or ()), parser)
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in tools}:
                raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
            return ToolPlan("named", tuple(tools), parser, choice.function.name)
        return ToolPlan("required" if choice == "required" else "auto", tuple(tools), parser, None if parallel else "")

    @property
    def forced(self) -> bool:
        return self.mode in ("named", "required")

    def constraint(self) -> str | None:
        """The JSON schema the output must follow (forced modes), as JSON text."""
        params = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools}
        if self.mode == "named":
            assert self.named is not None
            return orjson.dumps(params[self.named]).decode()
        if self.mode != "required":
            return None
        one = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p}, "required": ["name", "parameters"]}
               for n, p in params.items()]
        array: dict[str, object] = {"type": "array", "items": {"anyOf": one}, "minItems": 1}
        if self.named == "":  # parallel_tool_calls: false
            array["maxItems"] = 1
        return orjson.dumps(array).decode()

    def template_tools(self) -> list[dict[str, object]] | None:
        """The tools as HF chat templates take them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a finished output."""
        if self.mode == "named":
            assert self.named is not None
            return None, [new_call(self.named, text)]
        if self.mode == "required":
            try:
                items = orjson.loads(text)
            except orjson.JSONDecodeError:
                return text, []
            return None, [new_call(i["name"], i.get("parameters")) for i in items if isinstance(i, dict) and "name" in i]
        if self.mode == "none":
            return text, []
        return parse_qwen(text) if self.parser == "qwen" else parse_llama3(text)

    def holds_back(self, text: str) -> int:
        """Streaming: how much of `text` may go out as content now. A forced call goes out
        parsed at the end; in auto mode, so does what may be the start of a call."""
        if self.mode != "auto":
            return 0 if self.forced else len(text)
        if self.parser == "llama3":  # a call is the whole output: hold all of it once it may be one
            head = text.lstrip()
            maybe_call = not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)
            return 0 if maybe_call else len(text)
        start = text.find("<tool_call>")
        if start >= 0:
            return start
        for k in range(min(len("<tool_call>") - 1, len(text)), 0, -1):  # a marker may be arriving
            if "<tool_call>".startswith(text[-k:]):
                return len(text) - k
        return len(text)


def parse_qwen(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for block in QWEN_CALL.findall(text):
        try:
            obj = orjson.loads(block)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append(new_call(obj["name"], obj.get("arguments", obj.get("parameters"))))
    if not calls:
        return text, []
    content = QWEN_CALL.sub("", text).strip()
    return content or None, calls


def parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    """The whole output is one or more JSON calls, separated by `;` (Llama-3.x's format)."""
    body, calls, decoder = text.strip().removeprefix(PYTHON_TAG).strip(), [], json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return text, []
        calls.append(new_call(obj["name"], obj.get("parameters", obj.get("arguments"))))
        while pos < len(body) and body[pos] in "; \n\t":
            pos += 1
    return (None, calls) if calls else (text, [])
