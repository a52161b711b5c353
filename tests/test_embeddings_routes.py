"""The embedding routes in-process over the fake engine (the fast tier): what a generation
server answers, what an embedding server's responses look like, how an abort or an engine
refusal becomes an error envelope. tests/test_embeddings.py runs them on a real model."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import httpx
import numpy as np
import pytest
from fake_engine import FakeEngine, client, engine, state  # noqa: F401 - the fixtures
from server_helpers import assert_error_envelope

from app.routes_embeddings import _encoded
from runtime.errors import InvalidRequest
from runtime.managers.embedding_manager import EmbeddingOutput


class FakeEmbedder:
    """An embedding engine's async_encode: the vector [n, 1, 0, ...] normalized, n = input length."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.fail: str | None = None  # "abort" | "invalid"

    async def __call__(self, ids: list[int], rid: str | None = None) -> EmbeddingOutput:
        assert rid is not None
        self.rids.append(rid)
        if self.fail == "invalid":
            raise InvalidRequest("duplicate rid", param="rid")
        vec = np.zeros(8)
        vec[:2] = len(ids), 1.0
        aborted = self.fail == "abort"
        return {
            "embedding": None if aborted else (vec / np.linalg.norm(vec)).astype(np.float32).tolist(),
            "meta_info": {"id": rid, "prompt_tokens": len(ids), "completion_tokens": 0, "cached_tokens": 0,
                          "finish_reason": {"type": "abort", "matched": None} if aborted else {"type": "length", "matched": 0},
                          "queue_time": 0.0, "first_token_time": None, "e2e_latency": 0.0},
        }


@pytest.fixture()
def embedder(engine: FakeEngine) -> FakeEmbedder:
    fake = FakeEmbedder()
    engine.settings = dataclasses.replace(engine.settings, is_embedding=True)
    engine.async_encode = fake  # type: ignore[attr-defined]
    return fake


@pytest.mark.parametrize(("path", "body"), [("/v1/embeddings", {"input": "hi"}), ("/encode", {"text": "hi"})])
async def test_embedding_routes_answer_400_on_a_generation_server(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    error = assert_error_envelope(await client.post(path, json=body), 400)
    assert error["code"] == "not_an_embedding_model" and "--is-embedding" in error["message"]


async def test_v1_embeddings_response_has_openai_shape(client: httpx.AsyncClient, embedder: FakeEmbedder) -> None:
    r = await client.post("/v1/embeddings", json={"input": ["ab", "abcd"], "model": "SmolLM2-135M-Instruct"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"object", "data", "model", "usage"} and body["object"] == "list"
    assert [(d["object"], d["index"]) for d in body["data"]] == [("embedding", 0), ("embedding", 1)]
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}  # one byte a token
    assert embedder.rids == [f"{r.headers['x-request-id']}-{i}" for i in range(2)]


async def test_base64_is_exactly_the_little_endian_float32_of_the_float_list(
    client: httpx.AsyncClient, embedder: FakeEmbedder
) -> None:
    floats = (await client.post("/v1/embeddings", json={"input": [1, 2, 3]})).json()["data"][0]["embedding"]
    packed = (await client.post("/v1/embeddings", json={"input": [1, 2, 3], "encoding_format": "base64"})).json()
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == floats
    vec = [0.1, -2.5e-8, 1 / 3]
    assert np.frombuffer(base64.b64decode(_encoded(vec, "base64")), dtype="<f4").tolist() == np.float32(vec).tolist()


async def test_dimensions_is_refused(client: httpx.AsyncClient, embedder: FakeEmbedder) -> None:
    error = assert_error_envelope(await client.post("/v1/embeddings", json={"input": "x", "dimensions": 8}), 400)
    assert error["param"] == "dimensions" and "Matryoshka" in error["message"]
    assert embedder.rids == []


async def test_native_encode_returns_one_output_or_a_list(client: httpx.AsyncClient, embedder: FakeEmbedder) -> None:
    one = (await client.post("/encode", json={"text": "abc", "rid": "r"})).json()
    assert set(one) == {"embedding", "meta_info"} and one["meta_info"]["id"] == "r"
    many = (await client.post("/encode", json={"input_ids": [[1], [2, 3]], "rid": ["x", "y"]})).json()
    assert [m["meta_info"]["id"] for m in many] == ["x", "y"]
    bad = await client.post("/encode", json={"input_ids": [[1], [2, 3]], "rid": ["x"]})
    assert "a list of rid" in assert_error_envelope(bad, 400)["message"]


async def test_an_aborted_or_refused_input_is_an_error_envelope(client: httpx.AsyncClient, embedder: FakeEmbedder) -> None:
    embedder.fail = "abort"
    assert assert_error_envelope(await client.post("/v1/embeddings", json={"input": "x"}), 503)["code"] == "request_aborted"
    embedder.fail = "invalid"
    assert assert_error_envelope(await client.post("/encode", json={"text": "x"}), 400)["param"] == "rid"
