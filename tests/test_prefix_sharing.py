"""Running requests share their prompt: a prompt enters the radix tree as soon as
its prefill is scheduled, not when the request ends, and greedy outputs stay
equal to HF transformers' while rows are rewritten to the tree's slots."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import assert_all_memory_free, assert_greedy_equal

MAX_NEW = 20
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
LAYOUTS = [(1, True), (1, False), (16, True), (16, False)]


def _ceil(n: int, page: int) -> int:
    return -(-n // page) * page


@pytest.mark.parametrize(("page", "overlap"), LAYOUTS)
def test_a_decoding_request_shares_its_prompt_with_later_ones(
    page: int, overlap: bool, make_engine: Any, prompts: list[list[int]], hf_oracle: Any
) -> None:
    long_prompt, short_prompts = prompts[4], prompts[:4]
    shared = long_prompt[:-8]
    reqs = [shared + tail for tail in ([1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12])]
    # One request per prefill round: each later one can only hit what a
    # still-running earlier one put in the tree.
    engine = make_engine(page_size=page, disable_overlap_schedule=not overlap,
                         chunked_prefill_size=-1, max_prefill_tokens=_ceil(len(reqs[0]), page))
    outs = engine.generate(reqs + short_prompts, GREEDY)
    for prompt, out in zip(reqs + short_prompts, outs):
        assert_greedy_equal(hf_oracle, prompt, out["output_ids"], MAX_NEW)
    aligned = len(shared) // page * page
    assert [o["meta_info"]["cached_tokens"] for o in outs[:4]] == [0, aligned, aligned, aligned]
    assert_all_memory_free(engine)


@pytest.mark.parametrize(("page", "overlap"), LAYOUTS)
def test_duplicate_prompts_in_one_batch_decode_from_the_tree_and_free_their_copies(
    page: int, overlap: bool, make_engine: Any, prompts: list[list[int]], hf_oracle: Any
) -> None:
    p = prompts[4]
    other = list(reversed(p))  # shares no prefix with p
    # Three copies of p are prefilled together. The first one's KV goes to the
    # tree; the other two give their copies back, and `other`, admitted while they
    # decode, is only able to fit by taking those freed slots: if a copy's row were
    # not rewritten to the tree's slots, it would read `other`'s KV.
    first_batch = 3 * _ceil(len(p), page)
    engine = make_engine(page_size=page, disable_overlap_schedule=not overlap, chunked_prefill_size=-1,
                         max_prefill_tokens=first_batch, max_total_tokens=_ceil(3 * (len(p) + MAX_NEW) + 64, page))
    reqs = [p, p, p, other]
    outs = engine.generate(reqs, GREEDY)
    for prompt, out in zip(reqs, outs):
        assert_greedy_equal(hf_oracle, prompt, out["output_ids"], MAX_NEW)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 0, 0, 0]  # all computed in the first round
    assert_all_memory_free(engine)
