"""Hostile and sloppy input on a real `sluice serve` (the tightly limited one, with a key):
oversized bodies, nulls, non-finite JSON numbers, non-JSON media types, seeds at the edge
of their range. Every answer is an error envelope with a 4xx or a 200, never a reset."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers import (
    LIMITED_BODY_BYTES,
    ServerProcess,
    assert_error_envelope,
    limited_server,
    sse_payloads,
)

BIG = 4 * 1024 * 1024  # far past the limit and past what socket buffers absorb unread
PIECE = 64 * 1024
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
    "/v1/chat/completions": CHAT,
    "/generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/tokenize": {"prompt": "Hi"},
    "/v1/detokenize": {"tokens": [1, 2]},
    "/abort_request": {"rid": "nothing-to-abort"},
}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return limited_server()


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client(timeout=60.0) as client:
        yield client


def _big_json() -> bytes:
    return b'{"prompt": "' + b"a" * BIG + b'"}'


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_body_declared_too_large_gets_a_413_and_a_clean_close(http: httpx.Client, path: str) -> None:
    r = http.post(path, content=_big_json(), headers={"Content-Type": "application/json"})
    error = assert_error_envelope(r, 413)
    assert error["code"] == "request_too_large" and str(LIMITED_BODY_BYTES) in error["message"]
    assert r.headers["connection"] == "close"


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_chunked_body_streaming_past_the_limit_gets_a_413(http: httpx.Client, path: str) -> None:
    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is counted as the body streams in
        body = _big_json()
        for start in range(0, len(body), PIECE):
            yield body[start : start + PIECE]

    r = http.post(path, content=chunked(), headers={"Content-Type": "application/json"})
    assert_error_envelope(r, 413)
    assert r.headers["connection"] == "close"


def test_the_413_is_read_whole_then_the_server_closes_without_a_reset(server: ServerProcess) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % BIG)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + b"a" * BIG)
        received = b""
        while chunk := sock.recv(65536):  # a reset would raise ConnectionResetError here
            received += chunk
    assert received.startswith(b"HTTP/1.1 413")
    assert received.endswith(b"}") and b'"request_too_large"' in received


def test_a_large_body_without_the_key_gets_its_401(server: ServerProcess) -> None:
    body = b'{"prompt": "' + b"a" * (LIMITED_BODY_BYTES // 2) + b'"}'

    def chunked() -> Iterator[bytes]:
        yield body
        yield b" " * BIG  # past the limit: still answered, never reset

    with httpx.Client(base_url=server.base_url, timeout=60.0) as anonymous:
        r = anonymous.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert assert_error_envelope(r, 401)["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_stream_null_and_other_nulls_are_not_given(http: httpx.Client, path: str) -> None:
    nulls = {"stream": None, "stream_options": None, "temperature": None, "seed": None, "stop": None, "n": None}
    if path == "/generate":
        nulls = {"stream": None, "rid": None, "return_logprob": None, "input_ids": None}
    r = http.post(path, json={**BODIES[path], **nulls})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    streamed = http.post(path, json={**BODIES[path], **nulls, "stream": True})
    assert streamed.status_code == 200 and sse_payloads(streamed)


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("number", [b"Infinity", b"-Infinity", b"NaN"])
def test_non_finite_json_numbers_are_refused_on_every_route(http: httpx.Client, path: str, number: bytes) -> None:
    raw = json.dumps(BODIES[path]).encode()[:-1] + b', "extra": ' + number + b"}"
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert assert_error_envelope(r, 400)["code"] == "invalid_json"


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_not_declared_json_is_415(http: httpx.Client, path: str, content_type: str | None) -> None:
    raw = json.dumps(BODIES[path]).encode()
    headers = {"Content-Type": content_type} if content_type else {}
    error = assert_error_envelope(http.post(path, content=raw, headers=headers), 415)
    assert error["code"] == "unsupported_media_type"


def test_json_with_a_charset_is_accepted(http: httpx.Client) -> None:
    raw = json.dumps(BODIES["/v1/tokenize"]).encode()
    for content_type in ("application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        assert http.post("/v1/tokenize", content=raw, headers={"Content-Type": content_type}).status_code == 200


@pytest.mark.parametrize("seed", [-1, 2**63, -(2**63)])
def test_an_out_of_range_seed_is_the_same_400_on_both_routes(http: httpx.Client, seed: int) -> None:
    openai = http.post("/v1/completions", json={**BODIES["/v1/completions"], "seed": seed})
    native = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "seed": seed}})
    assert assert_error_envelope(openai, 400) == assert_error_envelope(native, 400)
    assert openai.json()["error"]["param"] == "seed"


def test_the_largest_seed_with_n_2_is_served(http: httpx.Client) -> None:
    body = {**BODIES["/v1/completions"], "seed": 2**63 - 1, "n": 2, "temperature": 0.8}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    native = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, "seed": 2**63 - 1}})
    assert native.status_code == 200, native.text


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None}])
def test_a_chat_message_without_content_is_400(http: httpx.Client, message: dict[str, Any]) -> None:
    error = assert_error_envelope(http.post("/v1/chat/completions", json={"messages": [message]}), 400)
    assert error["param"] == "messages.0.content"
