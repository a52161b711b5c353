"""Embeddings on a real model: a tiny Qwen3 with random weights, saved as Qwen3-Embedding
saves its checkpoint (the base model's tensors, no `model.` prefix, tied embeddings) with
the default model's tokenizer. The reference is HF transformers' `AutoModel` on the same
weights in float32: its final-norm hidden states, pooled and L2-normalized in float64.

In-process engines check the runtime (pooling, batching, chunked prefill, overlap, memory);
one `sluice serve --is-embedding` subprocess checks the HTTP surface, the official openai
client included.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import assert_all_memory_free
from tests.server_helpers import ServerProcess, assert_error_envelope

# Ours vs HF, float32 both, on unit vectors of 64 dims: the largest elementwise difference
# measured was 1.5e-7 over every pooling, chunked or not (reductions in another order);
# this leaves a wide margin and still catches a wrong token, position, pooling or norm
# (those move entries by ~1e-1).
HF_TOL = 1e-5
# Ours vs ours with a different batch or chunking: the same float32 math, summed in
# another order.
SELF_TOL = 1e-5

TEXTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Hi",
    "The river rose slowly through the night, and by morning the low fields were under water. " * 4,
]
QWEN3_TINY = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=49152, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu",
)


@pytest.fixture(scope="module")
def qwen3_embedding_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    from transformers import AutoModel, Qwen3Config

    out = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    torch.manual_seed(0)
    base = AutoModel.from_config(Qwen3Config(**QWEN3_TINY), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF init leaves norms at 1: perturb everything so each is tested
        for name, p in base.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
    base.save_pretrained(out)  # Qwen3Model: tensors named without `model.`
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf_model(qwen3_embedding_dir: Path) -> Any:
    from transformers import AutoModel

    return AutoModel.from_pretrained(qwen3_embedding_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def token_ids(qwen3_embedding_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_embedding_dir)
    return [list(tok.encode(t)) for t in TEXTS]


def hf_embedding(hf_model: Any, ids: list[int], pooling: str) -> np.ndarray:
    with torch.inference_mode():
        hidden = hf_model(torch.tensor([ids])).last_hidden_state[0].double()
    pooled = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0).numpy()


def max_diff(a: Any, b: Any) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def embedder(make_engine: Callable[..., Any], model: Path, **overrides: Any) -> Any:
    return make_engine(model_path=str(model), is_embedding=True, max_total_tokens=4096, **overrides)


# ---- the runtime ---------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_match_hf_on_the_same_weights(
    pooling: str, make_engine: Callable[..., Any], qwen3_embedding_dir: Path, hf_model: Any, token_ids: list[list[int]]
) -> None:
    engine = embedder(make_engine, qwen3_embedding_dir, pooling=pooling)
    outs = engine.encode(TEXTS)  # texts: the engine tokenizes, as HF's tokenizer does
    for out, ids in zip(outs, token_ids):
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert len(out["embedding"]) == QWEN3_TINY["hidden_size"]
        assert abs(np.linalg.norm(out["embedding"]) - 1.0) < 1e-6
        assert max_diff(out["embedding"], hf_embedding(hf_model, ids, pooling)) < HF_TOL
    assert_all_memory_free(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_chunked_prefill_and_batching_give_the_same_vectors(
    pooling: str, overlap: bool, make_engine: Callable[..., Any], qwen3_embedding_dir: Path, hf_model: Any,
    token_ids: list[list[int]],
) -> None:
    # Chunks of 8: the long text runs in ~12 chunks, the others in one to three.
    engine = embedder(make_engine, qwen3_embedding_dir, pooling=pooling, chunked_prefill_size=8,
                      disable_overlap_schedule=overlap)
    batched = engine.encode(token_ids)
    singles = [engine.encode(ids) for ids in token_ids]
    for ids, one, many in zip(token_ids, singles, batched):
        assert max_diff(one["embedding"], many["embedding"]) < SELF_TOL
        assert max_diff(many["embedding"], hf_embedding(hf_model, ids, pooling)) < HF_TOL
    assert_all_memory_free(engine)


def test_last_pooling_reuses_cached_prefixes_and_gets_the_same_vector(
    make_engine: Callable[..., Any], qwen3_embedding_dir: Path, hf_model: Any, token_ids: list[list[int]]
) -> None:
    engine = embedder(make_engine, qwen3_embedding_dir, pooling="last")
    long = token_ids[3]
    first = engine.encode(long)
    extended = engine.encode(long + long[1:9])  # shares the whole first input
    again = engine.encode(long)
    assert extended["meta_info"]["cached_tokens"] == len(long) and again["meta_info"]["cached_tokens"] == len(long) - 1
    assert max_diff(first["embedding"], again["embedding"]) < SELF_TOL
    assert max_diff(extended["embedding"], hf_embedding(hf_model, long + long[1:9], "last")) < HF_TOL
    assert_all_memory_free(engine)


def test_auto_pooling_honours_a_sentence_transformers_config(
    make_engine: Callable[..., Any], qwen3_embedding_dir: Path, hf_model: Any, token_ids: list[list[int]], tmp_path: Path
) -> None:
    st_dir = tmp_path / "st"
    shutil.copytree(qwen3_embedding_dir, st_dir)
    (st_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))
    (st_dir / "1_Pooling").mkdir()
    (st_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    engine = embedder(make_engine, st_dir)
    assert engine.settings.pooling == "mean" and engine.settings.disable_radix_cache
    assert max_diff(engine.encode(token_ids[0])["embedding"], hf_embedding(hf_model, token_ids[0], "mean")) < HF_TOL


# ---- the HTTP surface ------------------------------------------------------------------------

EMBED_MODEL = "tiny-qwen3-embedding"


@pytest.fixture(scope="module")
def embedding_server(qwen3_embedding_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess("--model-path", str(qwen3_embedding_dir), "--is-embedding", "--pooling", "last",
                           "--served-model-name", EMBED_MODEL, "--chunked-prefill-size", "16").start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def embed(server: ServerProcess, **body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/embeddings", json={"model": EMBED_MODEL, **body}, timeout=120)


def test_v1_embeddings_answers_every_input_shape_as_openai_does(
    embedding_server: ServerProcess, hf_model: Any, token_ids: list[list[int]]
) -> None:
    one = embed(embedding_server, input=TEXTS[0])
    assert one.status_code == 200, one.text
    body = one.json()
    assert body["object"] == "list" and body["model"] == EMBED_MODEL
    assert body["usage"] == {"prompt_tokens": len(token_ids[0]), "total_tokens": len(token_ids[0])}
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    assert max_diff(item["embedding"], hf_embedding(hf_model, token_ids[0], "last")) < HF_TOL

    many = embed(embedding_server, input=TEXTS).json()  # the long text runs in chunks of 16
    assert [d["index"] for d in many["data"]] == list(range(len(TEXTS)))
    assert many["usage"]["prompt_tokens"] == sum(map(len, token_ids))
    for d, ids in zip(many["data"], token_ids):
        assert max_diff(d["embedding"], hf_embedding(hf_model, ids, "last")) < HF_TOL
    assert max_diff(many["data"][0]["embedding"], item["embedding"]) < SELF_TOL  # batch == single

    by_ids = embed(embedding_server, input=token_ids[1]).json()
    by_id_lists = embed(embedding_server, input=token_ids[:2]).json()
    assert max_diff(by_ids["data"][0]["embedding"], many["data"][1]["embedding"]) < SELF_TOL
    assert max_diff(by_id_lists["data"][0]["embedding"], many["data"][0]["embedding"]) < SELF_TOL

    # (Another request: the same vectors up to summation order; test_embeddings_routes.py
    # checks that one vector's base64 is exactly its float list.)
    b64 = embed(embedding_server, input=TEXTS, encoding_format="base64").json()
    for d, f in zip(b64["data"], many["data"]):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert decoded.shape == (QWEN3_TINY["hidden_size"],)
        assert max_diff(decoded, f["embedding"]) < SELF_TOL


def test_the_openai_client_gets_the_same_vectors(
    embedding_server: ServerProcess, hf_model: Any, token_ids: list[list[int]]
) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{embedding_server.base_url}/v1", api_key="none")
    result = client.embeddings.create(model=EMBED_MODEL, input=TEXTS[:3])  # the client asks for base64 and decodes it
    assert [d.index for d in result.data] == [0, 1, 2]
    assert result.usage.prompt_tokens == sum(len(ids) for ids in token_ids[:3])
    for d, ids in zip(result.data, token_ids):
        assert max_diff(d.embedding, hf_embedding(hf_model, ids, "last")) < HF_TOL
    floats = client.embeddings.create(model=EMBED_MODEL, input=TEXTS[2], encoding_format="float")
    assert max_diff(floats.data[0].embedding, result.data[2].embedding) < SELF_TOL


def test_native_encode_answers_one_or_a_list(embedding_server: ServerProcess, token_ids: list[list[int]]) -> None:
    url = f"{embedding_server.base_url}/encode"
    one = httpx.post(url, json={"text": TEXTS[0], "rid": "enc-1"}, timeout=60).json()
    assert set(one) == {"embedding", "meta_info"}
    assert one["meta_info"]["id"] == "enc-1" and one["meta_info"]["prompt_tokens"] == len(token_ids[0])
    assert one["meta_info"]["finish_reason"]["type"] == "length"
    batch = httpx.post(url, json={"input_ids": token_ids[:2]}, timeout=60).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert max_diff(batch[0]["embedding"], one["embedding"]) < SELF_TOL


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 32}, "dimensions"),
    ({"input": "x", "dimensions": "32"}, "dimensions"),
    ({"model": EMBED_MODEL}, "input"),
])
def test_bad_embedding_requests_get_openai_400s(embedding_server: ServerProcess, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{embedding_server.base_url}/v1/embeddings", json=body, timeout=30)
    assert assert_error_envelope(response, 400)["param"] == param


def test_too_long_input_and_unknown_model_are_refused(embedding_server: ServerProcess) -> None:
    error = assert_error_envelope(embed(embedding_server, input=[[17] * 1024]), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert assert_error_envelope(embed(embedding_server, input="x", model="gpt-4"), 404)["code"] == "model_not_found"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/generate", {"text": "Hi"}),
])
def test_generation_routes_answer_400_on_an_embedding_server(embedding_server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    error = assert_error_envelope(httpx.post(f"{embedding_server.base_url}{path}", json=body, timeout=30), 400)
    assert "--is-embedding" in error["message"] and "/v1/embeddings" in error["message"]


def test_an_embedding_server_reports_itself_and_frees_every_slot(embedding_server: ServerProcess) -> None:
    base = embedding_server.base_url
    assert httpx.get(f"{base}/health_generate", timeout=30).status_code == 200  # one embedding end to end
    assert httpx.get(f"{base}/get_model_info", timeout=10).json()["is_generation"] is False
    info = embedding_server.wait_all_kv_free()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"], info
    assert info["req_pool_free_rows"] == info["req_pool_size"], info


def test_the_embeddings_bench_reports_every_batch_size(qwen3_embedding_dir: Path, tmp_path: Path) -> None:
    from app.cli import build_parser
    from bench.embeddings import run

    out = tmp_path / "embeddings.jsonl"
    ns = build_parser().parse_args([
        "bench", "embeddings", "--model-path", str(qwen3_embedding_dir), "--batch-sizes", "1", "4", "--input-len", "16",
        "--inputs-per-size", "8", "--dtype", "float32", "--max-total-tokens", "4096", "--output-file", str(out),
    ])
    records = run(ns)
    assert [(r["batch_size"], r["inputs"]) for r in records] == [(1, 8), (4, 8)]
    assert all(r["embeddings_per_s"] > 0 and r["input_tokens_per_s"] == pytest.approx(16 * r["embeddings_per_s"]) for r in records)
    assert len(out.read_text().splitlines()) == 2
