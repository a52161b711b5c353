"""One request contract: `runtime.SamplingParams` declares, bounds and checks every sampling
param for the engine and both HTTP route families, which answer alike; engine chunks are
deltas the app renders directly. In-process over the fake engine, in milliseconds."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import orjson
import pytest
from fake_engine import FakeEngine, client, engine, fake_logprob, state  # noqa: F401 - the fixtures

from app.native_protocol import SamplingParamsBody
from app.openapi import openapi_document
from app.protocol import ChatCompletionRequest, CompletionRequest
from app.sampling import engine_fields
from runtime.sampling_params import PARAM_SPECS, SEED_END, SamplingParams

ROUTES = ("/v1/completions", "/generate")


def _body(path: str, **params: Any) -> dict[str, Any]:
    """A small request on `path` with sampling `params` under their SamplingParams names."""
    if path == "/generate":
        return {"text": "abc", "sampling_params": {"max_new_tokens": 2, **params}}
    return {"prompt": "abc", "max_tokens": 2, **params}


def test_the_native_sampling_params_are_exactly_the_engines() -> None:
    assert set(SamplingParamsBody.model_fields) == set(PARAM_SPECS)
    assert set(engine_fields(SamplingParamsBody).values()) == set(PARAM_SPECS)
    # The OpenAI routes name some differently (max_tokens, min_tokens, ...) but cover them all.
    assert set(engine_fields(CompletionRequest).values()) == set(PARAM_SPECS)
    assert set(engine_fields(ChatCompletionRequest).values()) == set(PARAM_SPECS)


def test_the_schema_documents_the_bounds_declared_in_sampling_params() -> None:
    schemas = openapi_document()["components"]["schemas"]
    for model, field in (("CompletionRequest", "top_p"), ("SamplingParamsBody", "top_p"),
                         ("ChatCompletionRequest", "max_completion_tokens")):
        prop = schemas[model]["properties"][field]
        number = next(b for b in prop.get("anyOf", [prop]) if b.get("type") in ("number", "integer"))
        spec = PARAM_SPECS["top_p" if field == "top_p" else "max_new_tokens"]
        assert {k: number[k] for k in spec.json_schema()} == spec.json_schema()
        assert prop["description"].startswith(spec.doc)


async def test_a_bound_changed_in_sampling_params_changes_both_routes(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    for path in ROUTES:
        assert (await client.post(path, json=_body(path, temperature=1.0))).status_code == 200
    monkeypatch.setitem(PARAM_SPECS, "temperature", dataclasses.replace(PARAM_SPECS["temperature"], le=0.5))
    for path in ROUTES:
        r = await client.post(path, json=_body(path, temperature=1.0))
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "temperature=1.0: must be a number in [0, 0.5]",
                                     "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}
        assert (await client.post(path, json=_body(path, temperature=0.5))).status_code == 200


@pytest.mark.parametrize("seed", [-1, SEED_END, -(2**63)])
async def test_an_out_of_range_seed_gets_the_same_400_on_both_routes(client: httpx.AsyncClient, seed: int) -> None:
    answers = [await client.post(path, json=_body(path, seed=seed)) for path in ROUTES]
    assert [r.status_code for r in answers] == [400, 400]
    assert answers[0].json() == answers[1].json()
    assert answers[0].json()["error"]["param"] == "seed"
    assert "[0, 2**63)" in answers[0].json()["error"]["message"]


async def test_the_largest_seed_works_on_both_routes_and_choice_seeds_wrap(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    top = SEED_END - 1
    assert (await client.post("/generate", json=_body("/generate", seed=top))).status_code == 200
    r = await client.post("/v1/completions", json={**_body("/v1/completions", seed=top), "n": 3})
    assert r.status_code == 200, r.text
    assert [p.seed for p in engine.calls] == [top, top, 0, 1]


async def test_engine_names_are_answered_under_the_names_the_route_uses(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "min_tokens": 3})
    assert r.json()["error"]["param"] == "min_tokens"
    assert r.json()["error"]["message"].startswith("min_tokens=3: ")
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_completion_tokens": -1})
    assert r.json()["error"]["param"] == "max_completion_tokens"
    r = await client.post("/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}})
    assert r.json()["error"]["param"] == "min_new_tokens"


async def test_the_engine_gets_a_typed_sampling_params(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/v1/completions", json={**_body("/v1/completions"), "top_k": 0, "min_tokens": 1,
                                                   "include_stop_str_in_output": True})
    assert r.status_code == 200
    (params,) = engine.calls
    assert isinstance(params, SamplingParams)
    assert (params.top_k, params.min_new_tokens, params.no_stop_trim, params.max_new_tokens) == (-1, 1, True, 2)


def _all_optional_null(schema: dict[str, Any]) -> dict[str, None]:
    return {name: None for name in schema["properties"] if name not in schema.get("required", [])}


@pytest.mark.parametrize(("path", "model", "body"), [
    ("/v1/completions", "CompletionRequest", {"prompt": "abc"}),
    ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi", "name": None}]}),
    ("/generate", "GenerateRequest", {"text": "abc"}),
])
async def test_every_optional_field_sent_as_null_counts_as_not_given(
    client: httpx.AsyncClient, path: str, model: str, body: dict[str, Any]
) -> None:
    schemas = openapi_document()["components"]["schemas"]
    nulls = {**_all_optional_null(schemas[model]), **body}
    if path == "/generate":
        nulls.pop("input_ids")
        nulls["sampling_params"] = _all_optional_null(schemas["SamplingParamsBody"])
    r = await client.post(path, json=nulls)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # "stream": null is not streaming


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}, {"role": "assistant"}])
async def test_a_chat_message_without_content_is_400(client: httpx.AsyncClient, message: dict[str, Any]) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": [message]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages.0.content"


def _events(body: bytes) -> list[dict[str, Any]]:
    events = [e.removeprefix(b"data: ") for e in body.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


async def test_openai_streams_carry_each_delta_once_and_add_up_to_the_final_body(client: httpx.AsyncClient) -> None:
    body = {"prompt": "abcdef", "max_tokens": 6, "logprobs": 2, "echo": True}
    final = (await client.post("/v1/completions", json=body)).json()["choices"][0]
    events = _events((await client.post("/v1/completions", json={**body, "stream": True})).content)
    choices = [e["choices"][0] for e in events]
    assert "".join(c["text"] for c in choices) == final["text"] == "abcdef" * 2
    streamed = [lp for c in choices if c["logprobs"] for lp in zip(*c["logprobs"].values(), strict=True)]
    assert streamed == list(zip(*final["logprobs"].values(), strict=True))
    assert final["logprobs"]["token_logprobs"][6:] == [fake_logprob(b) for b in b"abcdef"]


async def test_the_native_stream_sends_the_whole_output_so_far_with_each_delta(client: httpx.AsyncClient) -> None:
    body = {"text": "abcd", "sampling_params": {"max_new_tokens": 4}, "return_logprob": True, "top_logprobs_num": 1}
    final = (await client.post("/generate", json=body)).json()
    events = _events((await client.post("/generate", json={**body, "stream": True})).content)
    assert [e["text"] for e in events] == ["a", "ab", "abc", "abcd"]
    assert [e["delta"] for e in events] == ["a", "b", "c", "d"]
    assert [e["output_ids"] for e in events][-1] == final["output_ids"] == list(b"abcd")
    assert [len(e["meta_info"]["output_token_logprobs"]) for e in events] == [1, 2, 3, 4]
    assert events[-1]["meta_info"]["output_token_logprobs"] == final["meta_info"]["output_token_logprobs"]
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 4]
    assert "delta" not in final and final["text"] == "abcd"
    assert final["meta_info"]["output_top_logprobs"] == [[[fake_logprob(b), b]] for b in b"abcd"]


# ---- priority: a request-level field, bounded in runtime.sampling_params.REQUEST_SPECS ----------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
PRIORITY_ROUTES = {"/v1/completions": _body("/v1/completions"), "/v1/chat/completions": CHAT, "/generate": _body("/generate")}


@pytest.mark.parametrize("path", PRIORITY_ROUTES)
async def test_priority_reaches_the_engine_for_every_choice(client: httpx.AsyncClient, engine: FakeEngine, path: str) -> None:
    body = {**PRIORITY_ROUTES[path], "priority": -7}
    if path != "/generate":
        body["n"] = 2
    assert (await client.post(path, json=body)).status_code == 200
    assert engine.priorities == ([-7] if path == "/generate" else [-7, -7])
    engine.priorities.clear()
    assert (await client.post(path, json=PRIORITY_ROUTES[path])).status_code == 200
    assert set(engine.priorities) == {None}  # not given: the engine's default


async def test_a_batched_generate_takes_one_priority_per_prompt(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    r = await client.post("/generate", json={"text": ["ab", "cd", "ef"], "sampling_params": {"max_new_tokens": 1},
                                             "priority": [3, 0, -1]})
    assert r.status_code == 200, r.text
    assert engine.priorities == [3, 0, -1]
    r = await client.post("/generate", json={"text": ["ab", "cd"], "priority": [1]})
    assert r.status_code == 400 and "priority" in r.json()["error"]["message"]


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, "1", 1.5, True, [1]])
@pytest.mark.parametrize("path", PRIORITY_ROUTES)
async def test_a_priority_that_is_no_int32_is_a_400_before_anything_runs(
    client: httpx.AsyncClient, engine: FakeEngine, path: str, bad: object
) -> None:
    r = await client.post(path, json={**PRIORITY_ROUTES[path], "priority": bad})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "priority" in f"{error['param']} {error['message']}"
    if isinstance(bad, int) and not isinstance(bad, bool):  # the range: the engine's rule, in its words
        assert error["message"] == f"priority={bad}: must be an integer in [-2**31, 2**31 - 1]"
    assert engine.calls == []


def test_the_schema_documents_the_priority_bounds() -> None:
    schemas = openapi_document()["components"]["schemas"]
    for model in ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest"):
        prop = schemas[model]["properties"]["priority"]
        ints = [b.get("items", b) for b in prop["anyOf"] if b.get("type") in ("integer", "array")]
        assert ints and all((b["minimum"], b["maximum"]) == (-(2**31), 2**31 - 1) for b in ints), model
        assert prop["description"].startswith("Scheduling priority")
