"""The wire protocol of a real `sluice serve`: SSE framing byte by byte, error envelopes,
client disconnects freeing KV, and the native routes."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import orjson
import pytest
from server_helpers import (
    MODEL,
    ServerProcess,
    assert_error_envelope,
    iter_sse,
    poll_until,
    shared_server,
    sse_payloads,
)


@pytest.fixture(scope="session")
def server() -> ServerProcess:
    return shared_server()


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


LONG = {"max_tokens": 2000, "ignore_eos": True}  # far longer than any test waits for


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 5, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True,
                                  "n": 2, "stream_options": {"include_usage": True}}),
        ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 5}, "stream": True}),
    ],
)
def test_sse_framing_is_exactly_data_lines_then_done(http: httpx.Client, path: str, body: dict) -> None:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r)  # asserts every event is `data: <json>\n\n`, last is [DONE]
    assert payloads
    if path == "/generate":
        assert payloads[-1]["meta_info"]["finish_reason"] is not None
        assert "".join(p["delta"] for p in payloads) == payloads[-1]["text"]
    else:
        finished = [c for p in payloads for c in p["choices"] if c["finish_reason"] is not None]
        assert len(finished) == body.get("n", 1)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "temperature": 3.5}, "temperature"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [-1]}, None),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "hi", "stop": ""}, None),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, None),
    ],
)
def test_bad_completion_fields_are_400_envelopes(http: httpx.Client, body: dict, param: str | None) -> None:
    error = assert_error_envelope(http.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_bad_chat_fields_are_400_envelopes(http: httpx.Client) -> None:
    for body in (
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        {"messages": "hi"},
    ):
        assert_error_envelope(http.post("/v1/chat/completions", json=body), 400)


def test_malformed_json_and_non_object_bodies_are_400(http: httpx.Client) -> None:
    for raw in (b"{bad json", b"", b"[1, 2]", b"null", b'"text"', b"\xff\xfe"):
        r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        error = assert_error_envelope(r, 400)
        assert error["message"]


def test_unknown_model_route_and_method(http: httpx.Client) -> None:
    error = assert_error_envelope(http.post("/v1/completions", json={"model": "nope", "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert_error_envelope(http.get("/v1/nothing-here"), 404)
    r = http.get("/v1/completions")
    assert_error_envelope(r, 405)
    assert "POST" in r.headers["allow"]


def test_prompt_plus_max_tokens_over_the_context_is_400(http: httpx.Client) -> None:
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    error = assert_error_envelope(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": limit}), 400)
    assert error["code"] == "context_length_exceeded"
    long_prompt = list(range(100, 100 + limit))
    assert_error_envelope(http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1}), 400)


def test_oversized_body_is_413(server: ServerProcess) -> None:
    limit = server.server_info()["max_request_body_bytes"]
    big = b'{"prompt": "' + b"a" * (limit + 1) + b'"}'
    with server.client() as http:
        assert_error_envelope(http.post("/v1/completions", content=big), 413)

        def chunked():  # no Content-Length: the limit is enforced while the body streams in
            yield big[: len(big) // 2]
            yield big[len(big) // 2 :]

        assert_error_envelope(http.post("/v1/completions", content=chunked()), 413)
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def _assert_all_kv_returns(server: ServerProcess) -> None:
    info = server.wait_all_kv_free()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"], info


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_aborts_and_frees_every_kv_slot(server: ServerProcess, path: str) -> None:
    body = {"prompt": "Tell me a long story.", **LONG, "stream": True}
    if path.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], **LONG, "stream": True}
    aborted_before = server.server_info()["num_aborted_requests_total"]
    with server.client() as http, http.stream("POST", path, json=body) as r:
        events = iter_sse(r)
        next(events)
        next(events)  # generation is under way
    poll_until(lambda: server.server_info()["num_aborted_requests_total"] > aborted_before, timeout=30,
               what="the engine to abort the request")
    _assert_all_kv_returns(server)


def test_disconnect_mid_non_stream_request_aborts_it(server: ServerProcess) -> None:
    aborted_before = server.server_info()["num_aborted_requests_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Tell me a long story.", **LONG},
                   timeout=httpx.Timeout(10.0, read=1.5))
    poll_until(lambda: server.server_info()["num_aborted_requests_total"] > aborted_before, timeout=30,
               what="the engine to abort the request")
    _assert_all_kv_returns(server)


def test_disconnect_by_raw_socket_close_while_queued_for_headers(server: ServerProcess) -> None:
    """A client that sends a request and closes before any byte of the response."""
    body = b'{"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": true}'
    aborted_before = server.server_info()["num_aborted_requests_total"]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        poll_until(lambda: server.server_info()["num_running_reqs"] > 0, timeout=30, what="the request to run")
    poll_until(lambda: server.server_info()["num_aborted_requests_total"] > aborted_before, timeout=30,
               what="the engine to abort the request")
    _assert_all_kv_returns(server)


def test_flush_cache_refuses_while_a_request_runs(server: ServerProcess) -> None:
    body = {"prompt": "Go on.", **LONG, "stream": True}
    with server.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
        events = iter_sse(r)  # held: a dropped iterator closes the connection (= abort)
        next(events)
        error = assert_error_envelope(http.post("/flush_cache"), 400)
        assert error["code"] == "requests_running"
    _assert_all_kv_returns(server)


def test_abort_request_by_id_ends_the_stream_with_finish_reason_abort(server: ServerProcess) -> None:
    with server.client() as http:
        body = {"text": "Count to a thousand:", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
                "stream": True, "rid": "abort-me-1"}
        with http.stream("POST", "/generate", json=body) as r:
            events = iter_sse(r)
            next(events)
            assert http.post("/abort_request", json={"rid": "abort-me-1"}).status_code == 200
            rest = list(events)
        assert rest[-1] == b"[DONE]"
        last = orjson.loads(rest[-2])
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert_error_envelope(http.post("/abort_request", json={}), 400)
    _assert_all_kv_returns(server)


def test_generate_native_non_stream_and_validation(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200
    out = r.json()
    assert set(out) >= {"text", "output_ids", "meta_info"} and len(out["output_ids"]) <= 3
    same = http.post("/generate", json={"input_ids": http.post("/v1/tokenize", json={"prompt": "Hello"}).json()["tokens"],
                                        "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    assert same["text"] == out["text"]
    assert_error_envelope(http.post("/generate", json={"text": "hi", "sampling_params": {"bogus": 1}}), 400)
    assert_error_envelope(http.post("/generate", json={"text": "hi", "input_ids": [1]}), 400)
    assert_error_envelope(http.post("/generate", json={"input_ids": [10**9]}), 400)


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    tok = http.post("/v1/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    assert http.post("/v1/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "hello world"}
    chat = http.post("/v1/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tok["count"]
    assert_error_envelope(http.post("/v1/detokenize", json={"tokens": [10**9]}), 400)
    assert_error_envelope(http.post("/v1/tokenize", json={}), 400)


def test_info_and_health_routes(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    model_info = http.get("/get_model_info").json()
    assert model_info["is_generation"] is True and model_info["served_model_name"] == MODEL
    assert model_info["model_path"]
    info = http.get("/get_server_info").json()
    for key in ("port", "max_queued_requests", "max_total_num_tokens", "available_kv_tokens", "num_running_reqs"):
        assert key in info
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"]
    assert "CompletionRequest" in doc["components"]["schemas"]


EXACT_METRICS = {
    "gauge": ["sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
              "sglang:gen_throughput", "sglang:num_retracted_reqs", "vllm:num_requests_running",
              "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"],
    "counter": ["sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cached_tokens_total",
                "sglang:num_requests_total", "sglang:num_aborted_requests_total"],
    "histogram": ["sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
                  "sglang:e2e_request_latency_seconds", "sglang:queue_time_seconds"],
}


def test_metrics_use_exact_sglang_and_vllm_names(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": "Metrics", "max_tokens": 3, "stream": True})
    text = http.get("/metrics").text
    lines = text.splitlines()
    for kind, names in EXACT_METRICS.items():
        for name in names:
            assert f"# TYPE {name} {kind}" in lines, name
    label = f'{{model_name="{MODEL}"}}'
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and not line.startswith("#")}
    assert samples[f"sglang:num_requests_total{label}"] >= 1
    assert samples[f"sglang:generation_tokens_total{label}"] >= 1
    assert samples[f"sglang:time_to_first_token_seconds_count{label}"] >= 1
    assert samples[f"sglang:e2e_request_latency_seconds_count{label}"] >= 1
    assert not any("_created" in key for key in samples)
