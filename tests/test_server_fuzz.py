"""Property-based fuzz of the OpenAI and native routes, drawn from the app's /openapi.json.

Bodies start valid per the document (so they reach generation), then get mutated:
fields replaced by junk of any JSON type, required fields dropped, unknown fields
added, or the whole body replaced by garbage. Every answer must be a 2xx or a 4xx
error envelope, never a 5xx, never a hang; afterwards the server is healthy and
holds no request and no KV. Cost is bounded: <= 4 new tokens and n <= 2 when valid.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from server_helpers import (
    MODEL,
    ServerProcess,
    assert_error_envelope,
    poll_until,
    shared_server,
    sse_payloads,
)

Schema = dict[str, Any]

JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
)
JUNK = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    return shared_server()


class Schemas(dict[str, Schema]):
    """The document's component schemas (a short repr keeps hypothesis' reports readable)."""

    def __repr__(self) -> str:
        return f"Schemas({sorted(self)})"


@pytest.fixture(scope="session")
def schemas(server: ServerProcess) -> Schemas:
    doc = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()
    return Schemas(doc["components"]["schemas"])


def from_schema(schema: Schema, defs: Schema) -> st.SearchStrategy[Any]:
    """Values valid per the JSON-schema subset pydantic emits."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(defs[name], defs))
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, defs) for s in schema["anyOf"]))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -(2**64) - 1) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 2**64 + 1) - 1)
        return st.integers(min_value=lo, max_value=hi)
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum", -1e6)),
            max_value=schema.get("maximum", schema.get("exclusiveMaximum", 1e6)),
            exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
            allow_nan=False, allow_infinity=False,
        )
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 24), 24))
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=max(schema.get("minItems", 0), 4))
    if kind == "object" and "properties" in schema:
        props = {k: from_schema(v, defs) for k, v in schema["properties"].items()}
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    if kind == "object":
        return st.dictionaries(st.text(max_size=6), JUNK, max_size=2)
    return JUNK  # {}: any JSON


def _bounded(body: dict[str, Any], data: st.DataObject, kind: str) -> None:
    """Keep a valid body cheap: a few tokens, a few choices, usually the served model."""
    if kind == "generate":
        params, budget = body.get("sampling_params"), {"max_new_tokens": data.draw(st.integers(1, 4))}
        if isinstance(params, list):  # a batch: one per prompt
            body["sampling_params"] = [{**p, **budget} if isinstance(p, dict) else p for p in params]
        else:
            body["sampling_params"] = {**(params or {}), **budget}
        body.pop("rid", None)  # random rids may collide with each other: a 400 by design
        return
    if kind == "openai":
        body["max_tokens"] = data.draw(st.integers(1, 4))
        body.pop("max_completion_tokens", None)
        for key in ("n", "best_of"):
            if isinstance(body.get(key), int):
                body[key] = min(body[key], 2)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 2 and isinstance(prompt[0], str | list):
            body["prompt"] = prompt[:2]
    if data.draw(st.booleans()):
        body["model"] = MODEL


def _mutate(body: dict[str, Any], data: st.DataObject, fields: list[str]) -> Any:
    for _ in range(data.draw(st.integers(0, 3))):
        action = data.draw(st.sampled_from(["junk", "drop", "unknown", "huge", "whole"]))
        if action == "junk":
            body[data.draw(st.sampled_from(fields))] = data.draw(JUNK)
        elif action == "drop" and body:
            body.pop(data.draw(st.sampled_from(sorted(body))))
        elif action == "unknown":
            body[data.draw(st.text(min_size=1, max_size=8))] = data.draw(JUNK)
        elif action == "huge":
            body[data.draw(st.sampled_from(fields))] = data.draw(
                st.sampled_from([10**12, -(10**12), 2**63, 1e300, -1e300, "x" * 5000, [0] * 5000])
            )
        elif action == "whole":
            return data.draw(JUNK)
    return body


def _keep_cheap(body: Any, path: str) -> None:
    """Mutations may drop or re-draw the token budget; never let one request generate for
    long (chat's default is the whole context). Only valid-and-large values are lowered."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 16 < value < 100_000:
            body[key] = 16
    if path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = 4
    params = body.get("sampling_params")
    if path == "/generate" and isinstance(params, dict) and not isinstance(params.get("max_new_tokens"), int):
        params["max_new_tokens"] = 4


def _check(response: httpx.Response, body: Any) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500], body)
    if response.status_code >= 400:
        assert_error_envelope(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        payloads = sse_payloads(response)
        assert not any("error" in p for p in payloads), payloads
    else:
        assert isinstance(response.json(), dict | list)  # a batched /generate answers a list


# path -> (request schema, kind of bounding)
ROUTES = {
    "/v1/completions": ("CompletionRequest", "openai"),
    "/v1/chat/completions": ("ChatCompletionRequest", "openai"),
    "/generate": ("GenerateRequest", "generate"),
    "/v1/tokenize": ("TokenizeRequest", "tokenize"),
}


def _fuzz(server: ServerProcess, defs: Schemas, data: st.DataObject, path: str) -> None:
    model, kind = ROUTES[path]
    body = data.draw(from_schema(defs[model], defs))
    _bounded(body, data, kind)
    body = _mutate(body, data, sorted(defs[model]["properties"]))
    _keep_cheap(body, path)
    raw = json.dumps(body).encode() if data.draw(st.integers(0, 9)) else data.draw(st.binary(max_size=64))
    response = httpx.post(f"{server.base_url}{path}", content=raw, headers={"Content-Type": "application/json"},
                          timeout=REQUEST_TIMEOUT)
    _check(response, body)


# No shrinking: replaying a failure that hangs would multiply the request timeout.
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.reuse, Phase.generate])
REQUEST_TIMEOUT = 60.0  # a valid fuzzed request generates at most 2 x 2 x 4 tokens


@FUZZ
@given(data=st.data())
def test_fuzzed_completion_bodies_get_2xx_or_4xx_envelopes(server: ServerProcess, schemas: Schemas,
                                                           data: st.DataObject) -> None:
    _fuzz(server, schemas, data, "/v1/completions")


@FUZZ
@given(data=st.data())
def test_fuzzed_chat_bodies_get_2xx_or_4xx_envelopes(server: ServerProcess, schemas: Schemas,
                                                     data: st.DataObject) -> None:
    _fuzz(server, schemas, data, "/v1/chat/completions")


@settings(FUZZ, max_examples=30)
@given(data=st.data())
@pytest.mark.parametrize("path", ["/generate", "/v1/tokenize"])
def test_fuzzed_native_bodies_get_2xx_or_4xx_envelopes(server: ServerProcess, schemas: Schemas, data: st.DataObject,
                                                       path: str) -> None:
    _fuzz(server, schemas, data, path)


def test_server_is_healthy_and_idle_after_fuzzing(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    poll_until(lambda: server.server_info()["inflight_requests"] == 0, timeout=30, what="in-flight requests to end")
    info = server.wait_all_kv_free()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"], info
