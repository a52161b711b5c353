"""Embedding requests through the real scheduler on the stub worker (the fast tier).

An embedding StubWorker answers each chunk with pooled `stub_hidden_states` of the
sequence it reads back through req_to_token and the KV slots, so a wrong slot, prefix
or chunk boundary changes the vector; `embedding_reference` (the whole prompt pooled
in one go) is what every output must equal. `make_stub` checks after every test that
every KV slot and request row is free again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from config.settings import EngineSettings, SettingsError
from runtime.engine import Engine
from runtime.errors import InvalidRequest
from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.pooler import resolve_pooling, sentence_transformers_pooling
from runtime.model_executor.stub_worker import embedding_reference
from tests.conftest import assert_all_memory_free
from tests.stub_engine import CONFIGS, OVERLAP, abort_when, make_prompts, pause_when, record_forwards

POOLINGS = ("last", "mean", "cls")
# The stub's partials are float32 sums: combining them over chunks rounds differently
# from pooling the whole prompt at once, by a few float32 ulps of a unit vector.
STUB_TOL = 1e-6
LENGTHS = [1, 5, 17, 40, 100, 233]


def assert_embeddings(outs: list[Any], prompts: list[list[int]], pooling: str) -> None:
    for out, prompt in zip(outs, prompts):
        assert out["meta_info"]["finish_reason"] == {"type": "length", "matched": 0}
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        ref = embedding_reference(prompt, pooling)  # type: ignore[arg-type]
        assert len(out["embedding"]) == len(ref)
        assert max(abs(a - b) for a, b in zip(out["embedding"], ref)) < STUB_TOL, (len(prompt), pooling)


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("pooling", POOLINGS)
def test_every_scheduler_config_embeds_like_one_whole_prompt_pass(
    pooling: str, config: str, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(is_embedding=True, pooling=pooling, disable_overlap_schedule=overlap, **CONFIGS[config])
    prompts = make_prompts(LENGTHS, seed=3)
    assert_embeddings(list(engine.encode(prompts)), prompts, pooling)  # type: ignore[arg-type]
    # Again, one by one: with last pooling the radix cache now holds every prompt.
    for prompt in prompts[:3]:
        assert_embeddings([engine.encode(prompt)], [prompt], pooling)


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("pooling", POOLINGS)
def test_a_long_input_is_chunked_and_no_request_ever_decodes(
    pooling: str, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(is_embedding=True, pooling=pooling, chunked_prefill_size=16, disable_overlap_schedule=overlap)
    log = record_forwards(engine)
    prompts = make_prompts([300, 7, 50], seed=5)
    assert_embeddings(list(engine.encode(prompts)), prompts, pooling)  # type: ignore[arg-type]
    assert {m.forward_mode for m in log} == {ForwardMode.EXTEND}
    assert len(log) >= 300 // 16
    assert engine.scheduler.running_batch.is_empty()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_mean_and_cls_pooling_turn_the_radix_cache_off(pooling: str, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(is_embedding=True, pooling=pooling)
    assert engine.settings.disable_radix_cache
    prompt = make_prompts([64], seed=9)[0]
    first, again = engine.encode(prompt), engine.encode(prompt)
    assert again["meta_info"]["cached_tokens"] == 0  # type: ignore[index]
    assert first["embedding"] == again["embedding"]  # type: ignore[index]


def test_last_pooling_reuses_a_cached_prefix(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(is_embedding=True, pooling="last")
    assert not engine.settings.disable_radix_cache
    prompt = make_prompts([64], seed=9)[0]
    first, again = engine.encode(prompt), engine.encode(prompt)
    assert again["meta_info"]["cached_tokens"] == 63  # type: ignore[index]
    assert first["embedding"] == again["embedding"]  # type: ignore[index]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
async def test_abort_mid_chunked_input_ends_it_and_frees_its_chunks(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(is_embedding=True, pooling="mean", chunked_prefill_size=16, disable_overlap_schedule=overlap)
    long_prompt, short = make_prompts([400, 20], seed=11)
    chunks: list[int] = []

    def third_chunk_launched(mwb: Any) -> bool:
        req = engine.scheduler.reqs_by_rid.get("long")
        if req is not None and req.req_pool_idx in mwb.req_pool_indices:
            chunks.append(1)
        return len(chunks) == 3

    abort_when(engine, "long", third_chunk_launched)
    out = await engine.async_encode(long_prompt, rid="long")
    assert out["embedding"] is None and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert_embeddings([await engine.async_encode(short)], [short], "mean")  # serving goes on


async def test_cancelling_an_encode_caller_mid_chunks_aborts_it_and_frees_its_memory(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(is_embedding=True, pooling="mean", chunked_prefill_size=16)
    long_prompt, short = make_prompts([400, 20], seed=13)

    def second_chunk(mwb: Any) -> bool:
        req = engine.scheduler.reqs_by_rid.get("c")
        return req is not None and req.req_pool_idx in mwb.req_pool_indices and mwb.extend_prefix_lens[0] > 0

    pause = pause_when(engine, second_chunk)
    caller = asyncio.ensure_future(engine.async_encode(long_prompt, rid="c"))
    assert await asyncio.to_thread(pause.reached.wait, 30)
    caller.cancel()  # what a client that disconnects from /v1/embeddings does
    with pytest.raises(asyncio.CancelledError):
        await caller
    pause.release.set()
    assert_all_memory_free(engine)
    assert engine.get_server_info()["num_aborted_requests_total"] == 1
    assert_embeddings([await engine.async_encode(short)], [short], "mean")


def test_generation_and_embedding_requests_are_refused_on_the_other_kind_of_engine(make_stub: Callable[..., Engine]) -> None:
    embedder, generator = make_stub(is_embedding=True), make_stub()
    with pytest.raises(InvalidRequest, match="embedding model"):
        embedder.generate([17, 18], {"max_new_tokens": 2})
    with pytest.raises(InvalidRequest, match="--is-embedding"):
        generator.encode([17, 18])
    with pytest.raises(InvalidRequest, match="context length"):
        embedder.encode(list(range(17, 17 + embedder.model_config.context_len)))
    with pytest.raises(InvalidRequest, match="empty"):
        embedder.encode([])


# ---- settings ------------------------------------------------------------------------


def test_is_embedding_refuses_tensor_and_pd_parallel_settings() -> None:
    with pytest.raises(SettingsError, match="is_embedding"):
        EngineSettings(is_embedding=True, tp_size=2)
    with pytest.raises(SettingsError, match="is_embedding"):
        EngineSettings(is_embedding=True, disaggregation_mode="prefill")
    with pytest.raises(SettingsError, match="pooling"):
        EngineSettings(is_embedding=True, pooling="max")  # type: ignore[arg-type]


def _sentence_transformers_dir(tmp_path: Path, modes: dict[str, bool], extra: tuple[str, ...] = ()) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    modules += [{"idx": 2 + i, "name": str(2 + i), "path": f"{2 + i}_X", "type": t} for i, t in enumerate(extra)]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return tmp_path


@pytest.mark.parametrize(("mode", "method"), [("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
                                              ("pooling_mode_cls_token", "cls")])
def test_auto_pooling_reads_the_sentence_transformers_config(tmp_path: Path, mode: str, method: str) -> None:
    model_dir = _sentence_transformers_dir(tmp_path, {mode: True, "pooling_mode_max_tokens": False},
                                           ("sentence_transformers.models.Normalize",))
    resolved = resolve_pooling(EngineSettings(is_embedding=True), model_dir)
    assert resolved.pooling == method
    assert resolved.disable_radix_cache == (method != "last")
    assert resolve_pooling(EngineSettings(is_embedding=True, pooling="last"), model_dir).pooling == "last"  # a flag wins


def test_auto_pooling_is_last_without_a_sentence_transformers_config(tmp_path: Path) -> None:
    assert sentence_transformers_pooling(tmp_path) is None
    assert resolve_pooling(EngineSettings(is_embedding=True), tmp_path).pooling == "last"
    assert resolve_pooling(EngineSettings(), tmp_path).pooling == "auto"  # a generation server: untouched


@pytest.mark.parametrize(("modes", "extra"), [
    ({"pooling_mode_max_tokens": True}, ()),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, ()),
    ({"pooling_mode_mean_tokens": True}, ("sentence_transformers.models.Dense",)),
])
def test_auto_pooling_refuses_what_it_cannot_reproduce(tmp_path: Path, modes: dict[str, bool], extra: tuple[str, ...]) -> None:
    model_dir = _sentence_transformers_dir(tmp_path, modes, extra)
    with pytest.raises(SettingsError):
        resolve_pooling(EngineSettings(is_embedding=True), model_dir)
    assert resolve_pooling(EngineSettings(is_embedding=True, pooling="mean"), model_dir).pooling == "mean"
