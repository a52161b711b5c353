"""API gaps closed in #14: the X-Request-Id header and logit_bias."""

from __future__ import annotations

import httpx
import orjson
import pytest
from fake_engine import FakeEngine, client, engine, state  # noqa: F401 - fixtures
from server_helpers import MODEL, shared_server


async def test_x_request_id_names_the_request_and_is_echoed(engine: FakeEngine, client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}, headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-42" and r.json()["id"] == "req-42"
    r = await client.post("/v1/chat/completions", headers={"X-Request-Id": "req-43"},
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2, "stream": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-43"
    assert engine.rids == ["req-42", "req-43-0", "req-43-1"]  # the engine's rids: abortable by name
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}, headers={"X-Request-Id": "x" * 300})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"


async def test_a_request_without_the_header_still_gets_its_id_echoed(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.headers["x-request-id"] == r.json()["id"]


async def test_logit_bias_out_of_range_or_vocab_is_a_400(client: httpx.AsyncClient) -> None:
    for bias in ({"5": 101}, {"-1": 1}, {"x": 1}):
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "logit_bias": bias})
        assert r.status_code == 400, (bias, r.text)
        assert r.json()["error"]["param"] == "logit_bias"


@pytest.mark.slow
def test_logit_bias_moves_greedy_output_on_the_real_model() -> None:
    server = shared_server()

    def ids(**extra: object) -> list[int]:
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0, **extra}}
        r = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return list(r.json()["output_ids"])

    plain = ids()
    banned = ids(logit_bias={str(plain[0]): -100})
    assert plain[0] not in banned
    forced = ids(logit_bias={"42": 100})
    assert forced == [42] * 6
    r = httpx.post(f"{server.base_url}/generate", timeout=30, json={"text": "x", "sampling_params": {"logit_bias": {"999999": 1}}})
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


async def test_a_batched_generate_answers_a_list_in_prompt_order(engine: FakeEngine, client: httpx.AsyncClient) -> None:
    body = {"text": ["ab", "xyz"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}], "rid": ["r1", "r2"]}
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert [o["text"] for o in r.json()] == ["ab", "xyz"] and [o["meta_info"]["id"] for o in r.json()] == ["r1", "r2"]
    r = await client.post("/generate", json={"input_ids": [[97, 98], [120]], "sampling_params": {"max_new_tokens": 2}, "stream": True})
    events = [orjson.loads(e.removeprefix(b"data: ")) for e in r.content.split(b"\n\n") if e and e != b"data: [DONE]"]
    last = {e["index"]: e["text"] for e in events}
    assert last == {0: "ab", 1: "x"}
    for bad in ({"text": ["a", "b"], "rid": ["only-one"]}, {"text": "a", "sampling_params": [{}, {}]}):
        r = await client.post("/generate", json=bad)
        assert r.status_code == 400, (bad, r.text)
