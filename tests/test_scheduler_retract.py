"""Retraction under memory pressure on the stub worker: with a KV pool far too small
for every admitted request to finish, the scheduler sends requests back to the
waiting queue, and each still ends with exactly the oracle's tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.engine import Engine
from tests.stub_engine import OVERLAP, finish_types, generate_all, greedy, make_prompts, oracle, output_ids

POOL = 256
MAX_NEW = 64
LENGTHS = [10 + (7 * i) % 31 for i in range(16)]  # 10..40 tokens
# A low conservativeness admits on optimistic decode estimates, so requests admitted
# while others decode overcommit the pool and the decode rounds must retract.
TIGHT = dict(max_total_tokens=POOL, chunked_prefill_size=32, schedule_conservativeness=0.3)
VARIANTS = {"radix": {}, "no-radix": {"disable_radix_cache": True}, "mixed": {"enable_mixed_chunk": True}}


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page", [1, 4, 16])
def test_a_pool_too_small_for_all_retracts_and_outputs_still_equal_the_oracle(
    page: int, variant: str, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(**TIGHT, **VARIANTS[variant], page_size=page, disable_overlap_schedule=overlap)
    prompts = make_prompts(LENGTHS, seed=5)
    outs = generate_all(engine, prompts, greedy(MAX_NEW))
    assert engine.get_server_info()["num_retracted_reqs_total"] > 0
    assert output_ids(outs) == [oracle(engine, p, MAX_NEW) for p in prompts]
    assert finish_types(outs) == ["length"] * len(prompts)


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("page", [1, 4, 16])
def test_the_largest_request_the_pool_admits_finishes_among_competitors(
    page: int, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(**TIGHT, page_size=page, disable_overlap_schedule=overlap)
    prompts = make_prompts([100] + LENGTHS[:6], seed=6)
    # Admission's limit: prompt + max_new_tokens <= max_total_tokens - page_size.
    biggest = POOL - page - 100
    max_new = [biggest] + [MAX_NEW] * 6
    outs = generate_all(engine, prompts, [greedy(n) for n in max_new])
    assert output_ids(outs) == [oracle(engine, p, n) for p, n in zip(prompts, max_new)]
    assert engine.get_server_info()["num_retracted_reqs_total"] > 0
