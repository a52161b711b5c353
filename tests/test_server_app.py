"""The ASGI app in-process over a scripted fake engine: the paths a real model cannot
trigger on demand (an engine failure mid-stream, an engine crash, a full queue,
startup and draining) in milliseconds, without loading a model."""

from __future__ import annotations

import httpx
import pytest
from fake_engine import FakeEngine, client, engine, state  # noqa: F401 - the fixtures

from app.state import AppState, Phase


def _events(body: bytes) -> list[bytes]:
    assert body.endswith(b"\n\n")
    return [e.removeprefix(b"data: ") for e in body[:-2].split(b"\n\n")]


async def test_streamed_echo_through_the_fake_engine(client: httpx.AsyncClient, state: AppState) -> None:
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True})
    assert r.status_code == 200
    events = _events(r.content)
    assert events[-1] == b"[DONE]" and b'"text":"c"' in events[-2] and b'"finish_reason":"length"' in events[-2]
    assert state.inflight == 0 and state.not_started == 0 and not state.groups


async def test_engine_failure_after_the_stream_started_is_an_error_event_then_done(
    client: httpx.AsyncClient, engine: FakeEngine, state: AppState
) -> None:
    engine.fail = "mid_stream"
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                        "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    events = _events(r.content)
    assert events[-1] == b"[DONE]"
    assert events[-2].startswith(b'{"error":{') and b'"type":"server_error"' in events[-2]
    assert len(engine.aborted) == 1  # the failed choice is aborted, its KV freed
    assert state.inflight == 0 and not state.rids


async def test_engine_validation_error_on_first_chunk_is_a_400_before_any_byte(
    client: httpx.AsyncClient, engine: FakeEngine
) -> None:
    engine.fail = "invalid"
    for stream in (True, False):
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "stream": stream})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "top_k"


async def test_unexpected_engine_crash_is_a_500_envelope_not_a_hang(client: httpx.AsyncClient, engine: FakeEngine,
                                                                    state: AppState) -> None:
    engine.fail = "crash"
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert state.inflight == 0


async def test_queue_at_its_limit_is_503(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.num_waiting_reqs = 2
    r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    engine.num_waiting_reqs = 1
    assert (await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})).status_code == 200


async def test_starting_and_draining_answer_503(client: httpx.AsyncClient, state: AppState) -> None:
    assert (await client.get("/health")).status_code == 200
    state.phase = Phase.DRAINING
    assert (await client.get("/health")).status_code == 503
    r = await client.post("/generate", json={"text": "abc"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    state.phase, state.engine = Phase.STARTING, None
    assert (await client.get("/health")).status_code == 503
    assert (await client.post("/v1/completions", json={"prompt": "abc"})).json()["error"]["code"] == "server_starting"


async def test_load_report_and_info_aliases_sglang_router_reads(client: httpx.AsyncClient, engine: FakeEngine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    info = {"max_total_num_tokens": 4096, "available_kv_tokens": 3000, "evictable_kv_tokens": 96,
            "num_running_reqs": 3, "num_waiting_reqs": 2}
    monkeypatch.setattr(engine, "get_server_info", lambda: info)
    # SGLang's shape: a list, one entry per data-parallel rank; the router reads num_tokens.
    assert (await client.get("/get_load")).json() == [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 4096 - 3000 - 96}]
    for new, old in (("/server_info", "/get_server_info"), ("/model_info", "/get_model_info")):
        assert (await client.get(new)).json() == (await client.get(old)).json()


async def test_generate_hands_each_prompt_its_answer_spans(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    """`answer_spans` with input_ids reach the engine per prompt; with text, or shaped for
    one prompt in a batch, they are a 400 before the engine sees anything."""
    body = {"input_ids": [[5, 6, 7, 8], [9, 10]], "answer_spans": [[[1, 3]], []], "sampling_params": {"max_new_tokens": 1}}
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert sorted(engine.answer_spans) == [(), ((1, 3),)]
    for bad in ({"text": "abc", "answer_spans": [[0, 1]]}, {"input_ids": [[5, 6], [7, 8]], "answer_spans": [[0, 1]]}):
        r = await client.post("/generate", json=bad)
        assert r.status_code == 400 and r.json()["error"]["message"]
    assert len(engine.answer_spans) == 2
