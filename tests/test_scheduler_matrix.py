"""Every scheduler configuration of the real-model suite, with overlap on and off, on
the stub worker: concurrent requests of different lengths get exactly the oracle's
tokens, repeats hit the prefix cache, and no decode step runs past max_new_tokens.
(Every stub engine ends with all memory free: see `make_stub`.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from runtime.engine import Engine
from tests.stub_engine import CONFIGS, OVERLAP, finish_types, generate_all, generate_one, greedy, make_prompts, oracle, output_ids

# One token, a few, several pages, and prompts many chunks long.
LENGTHS = [1, 3, 17, 40, 64, 150, 301]
MAX_NEW = [20, 1, 7, 33, 20, 12, 25]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("name", CONFIGS)
def test_concurrent_requests_of_different_lengths_get_the_oracles_tokens(
    name: str, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    config = CONFIGS[name]
    engine = make_stub(**config, disable_overlap_schedule=overlap)
    prompts = make_prompts(LENGTHS)
    params = [greedy(n) for n in MAX_NEW]

    outs = generate_all(engine, prompts, params)
    assert output_ids(outs) == [oracle(engine, p, n) for p, n in zip(prompts, MAX_NEW)]
    assert finish_types(outs) == ["length"] * len(prompts)
    assert [o["meta_info"]["completion_tokens"] for o in outs] == MAX_NEW
    stats = engine.scheduler.stats
    chunk = config.get("chunked_prefill_size")
    if chunk is not None:
        assert stats["num_chunked_prefills"] >= sum((n - 1) // chunk for n in LENGTHS)
    if config.get("enable_mixed_chunk"):
        assert stats["num_mixed_batches"] > 0

    again = generate_all(engine, prompts, params)
    assert output_ids(again) == output_ids(outs)
    page = config.get("page_size", 1)
    cached = [o["meta_info"]["cached_tokens"] for o in again]
    if config.get("disable_radix_cache"):
        assert cached == [0] * len(prompts)
    else:  # the whole prompt but its last token, in whole pages
        assert cached == [(n - 1) // page * page for n in LENGTHS]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("name", ["default", "page4-chunk10", "mixed-chunk16"])
def test_requests_one_at_a_time_get_the_oracles_tokens(name: str, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**CONFIGS[name], disable_overlap_schedule=overlap)
    for prompt, n in zip(make_prompts(LENGTHS, seed=1), MAX_NEW):
        out = generate_one(engine, prompt, greedy(n))
        assert out["output_ids"] == oracle(engine, prompt, n)
        assert out["meta_info"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_no_decode_step_runs_past_max_new_tokens(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    # With overlap the next batch is built before the running one's tokens are
    # known; a request that the running step completes must not be in it.
    engine = make_stub(disable_overlap_schedule=overlap)
    prompts = make_prompts([5, 9, 13])
    out = generate_one(engine, prompts[0], greedy(8))
    assert out["output_ids"] == oracle(engine, prompts[0], 8)
    assert engine.scheduler.stats.decode_steps == 7  # the prefill gives token 1

    outs = generate_all(engine, prompts, [greedy(n) for n in (3, 6, 9)])
    assert output_ids(outs) == [oracle(engine, p, n) for p, n in zip(prompts, (3, 6, 9))]
    assert engine.scheduler.stats.decode_steps == 7 + 8
    assert engine.worker.forwards == 8 + 9  # type: ignore[attr-defined]


def test_many_concurrent_requests_fill_every_row_and_queue_the_rest(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(max_running_requests=4, chunked_prefill_size=32)
    lengths = [1 + (7 * i) % 90 for i in range(24)]
    max_new = [1 + (5 * i) % 17 for i in range(24)]
    prompts = make_prompts(lengths, seed=2)
    outs = generate_all(engine, prompts, [greedy(n) for n in max_new])
    assert output_ids(outs) == [oracle(engine, p, n) for p, n in zip(prompts, max_new)]
    info: dict[str, Any] = engine.get_server_info()
    assert info["num_requests_total"] == 24 and info["generation_tokens_total"] == sum(max_new)
