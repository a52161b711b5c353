"""Request traces on a real `sluice serve` (the embedded model): the trace route behind
the API key, `return_trace` with the caller's `traceparent` on the OpenAI chat route, and
a client that disconnects mid-stream, whose trace says so once the server has ended it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_helpers import ServerProcess, assert_error_envelope, poll_until, start_traced_server

TRACEPARENT = "00-8d3cb0a2f1e9b6b8c3b0f0a1a2b3c4d5-1a2b3c4d5e6f7081-01"


@pytest.fixture(scope="module")
def traced_server() -> ServerProcess:
    return start_traced_server()


def trace_of(server: ServerProcess, rid: str) -> dict[str, Any] | None:
    r = httpx.get(f"{server.base_url}/v1/requests/{rid}/trace", headers=server.headers, timeout=10)
    return dict(r.json()) if r.status_code == 200 else None


def test_the_trace_route_is_behind_the_key_and_404s_unknown_ids(traced_server: ServerProcess) -> None:
    with traced_server.client() as http:
        r = http.post("/generate", json={"text": "The capital of France is", "rid": "srv-t1",
                                         "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert r.status_code == 200
        trace = http.get("/v1/requests/srv-t1/trace").json()
        assert trace["state"] == "finished" and trace["output_tokens"] == r.json()["meta_info"]["completion_tokens"]
        assert_error_envelope(http.get("/v1/requests/never-sent/trace"), 404)
    assert_error_envelope(httpx.get(f"{traced_server.base_url}/v1/requests/srv-t1/trace", timeout=10), 401)


def test_return_trace_carries_the_callers_traceparent(traced_server: ServerProcess) -> None:
    with traced_server.client() as http:
        body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5, "temperature": 0, "return_trace": True}
        r = http.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200
    trace = r.json()["choices"][0]["meta_info"]["trace"]
    assert trace["rid"] == r.json()["id"] and trace["traceparent"] == TRACEPARENT
    names = [e["event"] for e in trace["events"]]
    assert names[:3] == ["arrival", "tokenized", "queued"] and names[-1] == "finished"
    assert {"prefill_chunk", "prefilled", "first_token"} <= set(names)
    assert [s["name"] for s in trace["spans"]][-2:] == ["prefill", "decode"]


def test_a_client_disconnect_is_on_the_trace(traced_server: ServerProcess) -> None:
    rid = "srv-gone"
    body = {"text": "Count from one to a thousand:", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
    with traced_server.client() as http, http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first event: the request runs; then the connection closes
    trace = poll_until(lambda: (t := trace_of(traced_server, rid)) is not None and t["state"] == "finished" and t,
                       timeout=60, what="the server to end the abandoned request")
    assert trace["finish_reason"] == "abort" and 0 < trace["output_tokens"] < 2000
    whys = [e["why"] for e in trace["events"] if e["event"] == "abort_requested"]
    assert whys and whys[0] == "client_disconnected", whys
    assert trace["events"][-1]["event"] == "finished" and trace["events"][-1]["kv_slots"] > 0
