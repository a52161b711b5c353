"""Structured output on the default model through a real server: JSON schemas, regexes
and EBNF grammars (xgrammar masks applied by the sampler), the official openai
client's `parse`, and the guarantee that unconstrained requests beside constrained
ones are unchanged."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from server_helpers import MODEL, ServerProcess, shared_server

pytestmark = pytest.mark.slow  # a real server

S = {"type": "string", "maxLength": 12}  # short strings: a 135M model at T=0.8 rambles otherwise
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"city": S, "population": {"type": "integer", "minimum": 1}}, "required": ["city", "population"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}, "required": ["ok", "code"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}}, "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}, "required": ["id"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 5},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"first": S, "last": S}, "required": ["first", "last"]}, "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed", "pending"]}, "priority": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["status", "priority"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["sku", "qty"]}, "minItems": 1, "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["email"]},
    {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]},
    {"type": "object", "properties": {"title": S, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "genre": {"enum": ["drama", "comedy", "horror"]}}, "required": ["title", "year", "genre"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}, "required": ["matrix"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]{1,2}\\.[0-9]{1,2}$"}, "stable": {"type": "boolean"}}, "required": ["version", "stable"]},
    {"type": "object", "properties": {"config": {"type": "object", "properties": {"debug": {"type": "boolean"}, "level": {"enum": ["low", "high"]}, "retries": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["debug", "level", "retries"]}}, "required": ["config"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 8}, "count": {"type": "integer", "minimum": 0, "maximum": 1000}}, "required": ["word", "count"]},
]
REGEXES = [r"\d{3}-\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}", r"#[0-9a-f]{6}", r"(0|[1-9][0-9]{0,3})\.[0-9]{2}"]
# Arithmetic on two or three numbers (a finite language: the output must end); any
# output must be a Python expression.
EBNF = 'root ::= num op num (op num)?\nnum ::= [1-9] | [1-9] [0-9]\nop ::= "+" | "-" | "*"'
SAMPLES = 5


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return shared_server()


def _chat(server: ServerProcess, content: str, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 256, **body}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=payload, timeout=600)


async def _many(server: ServerProcess, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=900) as client:
        rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    for r in rs:
        assert r.status_code == 200, r.text
    return [r.json()["choices"][0] for r in rs]


def test_twenty_json_schemas_sampled_at_temperature_0_8_always_validate(server: ServerProcess) -> None:
    bodies = [
        {"model": MODEL, "messages": [{"role": "user", "content": "Reply with JSON for: " + json.dumps(schema)}],
         "max_tokens": 256, "temperature": 0.8, "seed": 1000 * i + k,
         "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
        for i, schema in enumerate(SCHEMAS) for k in range(SAMPLES)
    ]
    for body, choice in zip(bodies, asyncio.run(_many(server, bodies))):
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), body["response_format"]["json_schema"]["schema"])


def test_regex_and_ebnf_outputs_belong_to_their_language(server: ServerProcess) -> None:
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": "Answer:"}], "max_tokens": 64,
               "temperature": 0.8, "seed": k, "regex": rx} for rx in REGEXES for k in range(SAMPLES)]
    bodies += [{"model": MODEL, "messages": [{"role": "user", "content": "Write a sum:"}], "max_tokens": 64,
                "temperature": 0.8, "seed": k, "ebnf": EBNF} for k in range(SAMPLES)]
    for body, choice in zip(bodies, asyncio.run(_many(server, bodies))):
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop", choice
        if "regex" in body:
            assert re.fullmatch(body["regex"], text), (body["regex"], text)
        else:
            assert re.fullmatch(r"[1-9][0-9]?([-+*][1-9][0-9]?){1,2}", text), text
            compile(text, "<ebnf>", "eval")  # parses as an arithmetic expression


def test_json_object_mode_returns_a_json_object(server: ServerProcess) -> None:
    r = _chat(server, "Repeat this JSON object exactly: {\"cat\": \"meow\", \"legs\": 4}", temperature=0,
              response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_the_openai_client_parses_into_a_pydantic_model(server: ServerProcess) -> None:
    from openai import OpenAI

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=120)

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person, max_tokens=128,
        temperature=0,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


@pytest.mark.parametrize(("field", "value"), [("regex", "(ab"), ("json_schema", '{"type": "bogus"}'), ("ebnf", "root ::= nope")])
def test_an_invalid_constraint_is_a_400_that_uses_no_kv(server: ServerProcess, field: str, value: str) -> None:
    before = server.wait_all_kv_free()
    r = _chat(server, "hi", **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"invalid {field}:")
    after = server.server_info()
    assert after["available_kv_tokens"] == before["available_kv_tokens"] == before["max_total_num_tokens"]


def test_a_constraint_and_response_format_together_are_a_400(server: ServerProcess) -> None:
    r = _chat(server, "hi", regex="a+", response_format={"type": "json_object"})
    assert r.status_code == 400 and "give one constraint" in r.json()["error"]["message"]


def test_unconstrained_requests_are_unchanged_by_constrained_ones_beside_them(server: ServerProcess) -> None:
    plain = [{"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 24, "temperature": 0}
             for q in ("Name a fruit.", "What is the sky?", "Count to five.", "Say something kind.")]
    alone = [c["message"]["content"] for c in asyncio.run(_many(server, plain))]
    constrained = [{**plain[0], "temperature": 0.8, "seed": k, "max_tokens": 64,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[k]}}}
                   for k in range(6)]
    mixed = asyncio.run(_many(server, constrained + plain))[len(constrained):]
    assert [c["message"]["content"] for c in mixed] == alone


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_tool_call_returns_valid_arguments(server: ServerProcess, stream: bool) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
                                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        (call,) = calls.values()
        name, arguments = call["name"], call["arguments"]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        finish, (tool_call,) = choice.finish_reason, choice.message.tool_calls
        name, arguments = tool_call.function.name, tool_call.function.arguments
    assert finish == "tool_calls" and name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)


def test_required_tool_calls_name_given_functions_with_valid_parameters(server: ServerProcess) -> None:
    r = _chat(server, "What's the weather in Paris?", tools=TOOLS, tool_choice="required", temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice["message"]["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
