"""The radix prefix cache on the stub worker: a follow-up turn reuses the previous
answer's KV, running requests share their prompt with later ones, duplicates in one
batch give their copies back, and a full cache evicts the least recently used
prefix. `cached_tokens` in meta_info says what came from the cache."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.engine import Engine
from tests.stub_engine import OVERLAP, generate_all, generate_one, greedy, make_prompt, make_prompts, oracle, output_ids

PAGES = [1, 4, 16]


def ceil_page(n: int, page: int) -> int:
    return -(-n // page) * page


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("page", PAGES)
def test_a_follow_up_turn_reuses_the_kv_of_the_previous_answer(
    page: int, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(page_size=page, disable_overlap_schedule=overlap)
    prompt = make_prompt(50, seed=21)
    answer = generate_one(engine, prompt, greedy(13))["output_ids"]
    follow_up = prompt + answer + make_prompt(9, seed=22)
    out = generate_one(engine, follow_up, greedy(7))
    assert out["output_ids"] == oracle(engine, follow_up, 7)
    # Every token but the answer's last has KV (the last was never fed back).
    assert out["meta_info"]["cached_tokens"] == (len(prompt) + len(answer) - 1) // page * page
    info = engine.get_server_info()
    assert info["cached_tokens_total"] == out["meta_info"]["cached_tokens"]
    assert info["cache_hit_rate"] == info["cached_tokens_total"] / (len(prompt) + len(follow_up))


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("page", PAGES)
def test_a_decoding_request_shares_its_prompt_with_later_ones(page: int, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    shared = make_prompt(70, seed=23)
    prompts = [shared + [101 + i] for i in range(4)]
    # One request per prefill round: each later one can only hit what a still-running
    # earlier one put in the tree.
    engine = make_stub(page_size=page, disable_overlap_schedule=overlap, chunked_prefill_size=-1,
                       max_prefill_tokens=ceil_page(len(prompts[0]), page))
    outs = generate_all(engine, prompts, greedy(20))
    assert output_ids(outs) == [oracle(engine, p, 20) for p in prompts]
    aligned = len(shared) // page * page
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, aligned, aligned, aligned]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("page", PAGES)
def test_duplicate_prompts_in_one_batch_decode_from_the_tree_and_free_their_copies(
    page: int, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    (p,) = make_prompts([90], seed=24)
    other = list(reversed(p))  # shares no prefix with p
    # Three copies of p are prefilled together. The first one's KV goes to the tree;
    # the other two give their copies back, and `other`, admitted while they decode,
    # fits only by taking those freed slots: a copy whose row still pointed at its own
    # slots would read `other`'s tokens, and the stub would answer differently.
    first_batch = 3 * ceil_page(len(p), page)
    engine = make_stub(page_size=page, disable_overlap_schedule=overlap, chunked_prefill_size=-1,
                       max_prefill_tokens=first_batch, max_total_tokens=ceil_page(3 * (len(p) + 20) + 64, page))
    prompts = [p, p, p, other]
    outs = generate_all(engine, prompts, greedy(20))
    assert output_ids(outs) == [oracle(engine, q, 20) for q in prompts]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, 0, 0]  # all computed in the first round


@pytest.mark.parametrize("page", PAGES)
def test_a_full_cache_evicts_the_least_recently_used_prefix(page: int, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(page_size=page, max_total_tokens=256)
    prompts = make_prompts([60] * 6, seed=25)  # ~64 cached tokens each: 384 > 256
    for prompt in prompts:
        assert generate_one(engine, prompt, greedy(4))["output_ids"] == oracle(engine, prompt, 4)
    newest, oldest = generate_all(engine, [prompts[-1], prompts[0]], greedy(4))
    assert newest["meta_info"]["cached_tokens"] == 59 // page * page
    assert oldest["meta_info"]["cached_tokens"] == 0
    assert output_ids([newest, oldest]) == [oracle(engine, prompts[-1], 4), oracle(engine, prompts[0], 4)]
