"""Greedy outputs equal HF transformers' on the same weights (float32), whatever the
scheduler does: batching, radix cache on/off, chunked prefill, pages, mixed
batches, overlap on/off, cache hits and retraction. Every scenario ends with the
memory invariant."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import assert_all_memory_free, assert_greedy_equal

MAX_NEW = 20
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-radix": {"disable_radix_cache": True},
    "chunk16": {"chunked_prefill_size": 16},
    "page16": {"page_size": 16},
    "page16-chunk32-no-radix": {"page_size": 16, "chunked_prefill_size": 32, "disable_radix_cache": True},
    "mixed-chunk16": {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
    "no-overlap": {"disable_overlap_schedule": True},
    "torch-decode-attention": {"disable_cpu_kernels": True, "page_size": 16},
    "no-overlap-chunk16-page16": {"disable_overlap_schedule": True, "chunked_prefill_size": 16, "page_size": 16},
    "lpm-page4": {"schedule_policy": "lpm", "page_size": 4},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_greedy_matches_hf_and_repeats_hit_the_cache(name: str, make_engine: Any, prompts: list[list[int]], hf_oracle: Any) -> None:
    engine = make_engine(**CONFIGS[name])
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert_greedy_equal(hf_oracle, prompt, out["output_ids"], MAX_NEW)

    again = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, again):
        assert_greedy_equal(hf_oracle, prompt, out["output_ids"], MAX_NEW)
    cached = sum(o["meta_info"]["cached_tokens"] for o in again)
    if CONFIGS[name].get("disable_radix_cache"):
        assert cached == 0
    else:
        page = CONFIGS[name].get("page_size", 1)
        assert cached >= sum((len(p) - 1) // page * page for p in prompts) - page * len(prompts)

    stats = engine.scheduler.stats
    if "chunked_prefill_size" in CONFIGS[name]:
        assert stats["num_chunked_prefills"] > 0
    if CONFIGS[name].get("enable_mixed_chunk"):
        assert stats["num_mixed_batches"] > 0
    assert_all_memory_free(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_one_at_a_time_greedy_matches_hf(overlap: bool, make_engine: Any, prompts: list[list[int]], hf_oracle: Any) -> None:
    engine = make_engine(disable_overlap_schedule=not overlap)
    for prompt in prompts:
        out = engine.generate(prompt, GREEDY)
        assert_greedy_equal(hf_oracle, prompt, out["output_ids"], MAX_NEW)
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        assert out["meta_info"]["completion_tokens"] == MAX_NEW
    assert_all_memory_free(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_tiny_kv_pool_retracts_and_still_matches_hf(overlap: bool, make_engine: Any, prompts: list[list[int]], hf_oracle: Any) -> None:
    max_new = 48
    longest = max(len(p) for p in prompts)
    # Room for the longest request alone, far from room for all of them at once;
    # a low conservativeness admits them on optimistic decode estimates.
    pool = longest + max_new + 64
    engine = make_engine(
        max_total_tokens=pool, disable_overlap_schedule=not overlap, chunked_prefill_size=64, schedule_conservativeness=0.3
    )
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert_greedy_equal(hf_oracle, prompt, out["output_ids"], max_new)
    assert engine.get_server_info()["num_retracted_reqs_total"] > 0
    assert_all_memory_free(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_no_decode_step_runs_past_max_new_tokens(overlap: bool, make_engine: Any, prompts: list[list[int]], hf_oracle: Any) -> None:
    # With overlap the next batch is built before the running one's tokens are
    # known; a request that the running step completes must not be in it.
    engine = make_engine(disable_overlap_schedule=not overlap)
    out = engine.generate(prompts[0], {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert_greedy_equal(hf_oracle, prompts[0], out["output_ids"], 8)
    assert engine.scheduler.stats.decode_steps == 7  # the prefill gives token 1
    outs = engine.generate(prompts[:3], [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (3, 6, 9)])
    assert [len(o["output_ids"]) for o in outs] == [3, 6, 9]
    assert engine.scheduler.stats.decode_steps == 7 + 8
    assert_all_memory_free(engine)
