"""Auth, body-size and queue limits on a real `sluice serve` started with tight limits."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import openai
import pytest
from server_helpers import (
    LIMITED_API_KEY,
    LIMITED_BODY_BYTES,
    MODEL,
    ServerProcess,
    assert_error_envelope,
    iter_sse,
    limited_server,
    poll_until,
    sse_payloads,
)

API_KEY = LIMITED_API_KEY
BODY_LIMIT = LIMITED_BODY_BYTES


@pytest.fixture(scope="module")
def limited() -> ServerProcess:
    return limited_server()


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/generate"),
     ("GET", "/get_server_info"), ("POST", "/flush_cache"), ("GET", "/openapi.json"), ("GET", "/no-such-route"),
     ("GET", "/health_generate")],
)
def test_missing_or_wrong_api_key_is_401(limited: ServerProcess, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.request(method, f"{limited.base_url}{path}", headers=headers, json={"prompt": "hi"}, timeout=10)
        error = assert_error_envelope(r, 401)
        assert error["code"] == "invalid_api_key"


def test_probes_and_metrics_need_no_key(limited: ServerProcess) -> None:
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{limited.base_url}{path}", timeout=30).status_code == 200, path


def test_health_generate_runs_the_model_only_with_the_key(limited: ServerProcess) -> None:
    assert_error_envelope(httpx.get(f"{limited.base_url}/health_generate", timeout=30), 401)
    assert httpx.get(f"{limited.base_url}/health_generate", headers=limited.headers, timeout=30).status_code == 200


def test_the_right_key_works_with_the_openai_client(limited: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key=API_KEY, max_retries=0)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{limited.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_body_over_the_limit_is_413(limited: ServerProcess) -> None:
    with limited.client() as http:
        big = {"prompt": "a" * BODY_LIMIT, "max_tokens": 1}
        assert_error_envelope(http.post("/v1/completions", json=big), 413)
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_full_queue_is_503_and_frees_up_after(limited: ServerProcess) -> None:
    long = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    queued_result: dict[str, Any] = {}

    def queued_request() -> None:
        # Headers come with the first token, so this blocks while the request waits.
        with limited.client() as http, http.stream("POST", "/v1/completions", json=long) as r:
            queued_result["status"] = r.status_code
            queued_result["payloads"] = sse_payloads(r)

    with limited.client() as http, http.stream("POST", "/v1/completions", json=long) as running:
        events = iter_sse(running)  # held: a dropped iterator closes the connection (= abort)
        next(events)  # occupies the only running slot
        waiter = threading.Thread(target=queued_request)
        waiter.start()
        poll_until(lambda: limited.server_info()["num_waiting_reqs"] == 1, timeout=30, what="one queued request")
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        error = assert_error_envelope(r, 503)
        assert error["code"] == "queue_full" and r.headers["retry-after"]
        assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert queued_result["status"] == 200
    assert queued_result["payloads"][-1]["choices"][0]["finish_reason"] == "abort"
    poll_until(lambda: limited.server_info()["num_running_reqs"] == 0, timeout=30, what="the server to go idle")
    with limited.client() as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
