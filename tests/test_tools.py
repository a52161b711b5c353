"""Chat tool calls on the fast tier: the parsers of each chat format, what each
tool_choice constrains, and the chat route over the fake engine (which echoes the
templated prompt, so a prompt holding a `<tool_call>` block makes the "model" call it)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from fake_engine import FakeEngine, client, engine, state  # noqa: F401 - fixtures
from server_helpers import sse_payloads

from app.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from app.tools import ToolPlan, parse_llama3, parse_qwen

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(ADD)]


def test_qwen_blocks_become_calls_and_the_rest_stays_content() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = parse_qwen(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert parse_qwen("no calls here") == ("no calls here", [])
    assert parse_qwen("<tool_call>not json</tool_call>")[1] == []


def test_llama3_json_calls_with_and_without_the_python_tag() -> None:
    for text in ('{"name": "add", "parameters": {"a": 1, "b": 2}}', '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'):
        content, calls = parse_llama3(text)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    _, calls = parse_llama3('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "a;b"}}')
    assert [c.name for c in calls] == ["add", "get_weather"] and json.loads(calls[1].arguments) == {"city": "a;b"}
    assert parse_llama3("The answer is {not a call}") == ("The answer is {not a call}", [])


def test_streaming_holds_back_what_may_be_a_call() -> None:
    qwen = ToolPlan.of(TOOLS, "auto", "Qwen3ForCausalLM", True)
    assert qwen.holds_back("Sure, ") == len("Sure, ")
    assert qwen.holds_back("Sure, <tool_") == len("Sure, ")  # a marker may be arriving
    assert qwen.holds_back("Sure, <tool_call>{") == len("Sure, ")
    llama = ToolPlan.of(TOOLS, "auto", "LlamaForCausalLM", True)
    assert llama.holds_back('{"name"') == 0 and llama.holds_back("<|python") == 0 and llama.holds_back("Hi") == 2
    assert ToolPlan.of(TOOLS, "required", "LlamaForCausalLM", True).holds_back("[{") == 0


def test_each_tool_choice_constrains_as_documented() -> None:
    assert ToolPlan.of(TOOLS, "none", "X", True).constraint() is None
    assert ToolPlan.of(TOOLS, "auto", "X", True).constraint() is None
    named = ToolPlan.of(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}}), "X", True)
    assert orjson.loads(named.constraint() or "") == ADD["function"]["parameters"]
    required = orjson.loads(ToolPlan.of(TOOLS, "required", "X", False).constraint() or "")
    assert required["minItems"] == 1 and required["maxItems"] == 1  # parallel_tool_calls: false
    assert [o["properties"]["name"]["const"] for o in required["items"]["anyOf"]] == ["get_weather", "add"]
    with pytest.raises(ValueError, match="not in tools"):
        ToolPlan.of(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}}), "X", True)


def test_assistant_tool_call_turns_and_tool_results_are_accepted_messages() -> None:
    body = {"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ], "tools": [WEATHER]}
    req = ChatCompletionRequest.model_validate(body)
    assert req.messages[1].for_template()["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    with pytest.raises(ValueError, match="content is required"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user"}]})


@pytest.fixture
def qwen_engine(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    monkeypatch.setattr(engine.model_config, "architecture", "Qwen3ForCausalLM", raising=False)
    monkeypatch.setattr(engine.model_config, "context_len", 512, raising=False)
    return engine


CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


async def test_auto_reads_the_models_tool_call_whole_and_streamed(qwen_engine: FakeEngine, client: httpx.AsyncClient) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": CALL}], "tools": [ADD], "max_tokens": 200}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [("add", {"a": 1, "b": 2})]
    assert "<tool_call>" not in (message["content"] or "")
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    events = sse_payloads(r)
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    calls = [tc for e in events if e.get("choices") for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert "<tool_" not in content and content.startswith("<user>")  # what came before the call was streamed
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [(0, "add", {"a": 1, "b": 2})]


async def test_bad_tool_choices_are_400(qwen_engine: FakeEngine, client: httpx.AsyncClient) -> None:
    base: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for extra in ({"tool_choice": "required"}, {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                  {"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}}):
        r = await client.post("/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 400, (extra, r.text)
