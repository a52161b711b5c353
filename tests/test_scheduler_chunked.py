"""Chunked prefill on the stub worker: a prompt many chunks long is cut into chunks
that end on page boundaries whatever the chunk size, picks up after a cached
prefix, and running requests keep decoding between its chunks (or ride along in
mixed batches)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.engine import Engine
from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.worker import ModelWorkerBatch
from tests.stub_engine import OVERLAP, generate_all, generate_one, greedy, make_prompt, make_prompts, oracle, output_ids
from tests.stub_engine import record_forwards

# (page_size, chunked_prefill_size): chunk sizes that are not a whole number of pages.
PAGE_CHUNK = [(1, 10), (4, 10), (4, 16), (16, 24), (16, 40)]


def chunks_of(log: list[ModelWorkerBatch]) -> list[tuple[int, int]]:
    """(prefix, extend) of each prefill forward of a request running alone."""
    return [(m.extend_prefix_lens[0], m.extend_seq_lens[0]) for m in log if m.forward_mode == ForwardMode.EXTEND]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize(("page", "chunk"), PAGE_CHUNK, ids=[f"page{p}-chunk{c}" for p, c in PAGE_CHUNK])
def test_a_prompt_many_chunks_long_is_cut_at_page_boundaries(
    page: int, chunk: int, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(page_size=page, chunked_prefill_size=chunk, disable_overlap_schedule=overlap)
    log = record_forwards(engine)
    prompt = make_prompt(1001, seed=page * 100 + chunk)
    out = generate_one(engine, prompt, greedy(6))
    assert out["output_ids"] == oracle(engine, prompt, 6)

    chunks = chunks_of(log)
    whole_pages = chunk // page * page  # the most of the chunk budget that ends on a page boundary
    assert [n for _, n in chunks[:-1]] == [whole_pages] * (len(chunks) - 1)
    assert 0 < chunks[-1][1] <= chunk
    assert [p for p, _ in chunks] == [i * whole_pages for i in range(len(chunks))]  # each picks up where the last ended
    assert sum(n for _, n in chunks) == len(prompt)
    assert engine.scheduler.stats["num_chunked_prefills"] == len(chunks) - 1


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("page", [1, 4, 16])
def test_chunking_starts_after_the_cached_prefix(page: int, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(page_size=page, chunked_prefill_size=16, disable_overlap_schedule=overlap)
    first = make_prompt(200, seed=7)
    generate_one(engine, first, greedy(4))
    log = record_forwards(engine)
    follow_up = first + make_prompt(100, seed=8)
    out = generate_one(engine, follow_up, greedy(9))
    assert out["output_ids"] == oracle(engine, follow_up, 9)
    cached = 200 // page * page
    assert out["meta_info"]["cached_tokens"] == cached
    chunks = chunks_of(log)
    assert chunks[0][0] == cached and sum(n for _, n in chunks) == len(follow_up) - cached


def short_and_long(engine: Engine) -> tuple[list[list[int]], list[int]]:
    """A short request that decodes for a while, and a long prompt admitted with it."""
    prompts = make_prompts([5, 150], seed=3)
    max_new = [40, 3]
    outs = generate_all(engine, prompts, [greedy(n) for n in max_new])
    assert output_ids(outs) == [oracle(engine, p, n) for p, n in zip(prompts, max_new)]
    return prompts, max_new


def modes_while_chunking(log: list[ModelWorkerBatch]) -> list[tuple[ForwardMode, list[int]]]:
    """(mode, extend lengths) of each forward up to the long prompt's last chunk."""
    last_chunk = max(i for i, m in enumerate(log) if m.forward_mode != ForwardMode.DECODE)
    return [(m.forward_mode, m.extend_seq_lens) for m in log[: last_chunk + 1]]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_running_requests_ride_along_every_chunk_in_mixed_batches(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(chunked_prefill_size=16, page_size=4, enable_mixed_chunk=True, disable_overlap_schedule=overlap)
    log = record_forwards(engine)
    short_and_long(engine)
    modes = modes_while_chunking(log)
    assert modes[0][0] == ForwardMode.EXTEND and modes[0][1][0] == 5  # both prompts start together
    # From then on, each chunk carries the short request's decode (extend length 1).
    assert all(mode == ForwardMode.MIXED and lens[-1] == 1 for mode, lens in modes[1:])
    assert engine.scheduler.stats["num_mixed_batches"] == len(modes) - 1


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_running_requests_decode_between_any_two_chunks(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(chunked_prefill_size=16, page_size=4, disable_overlap_schedule=overlap)
    log = record_forwards(engine)
    short_and_long(engine)
    modes = [mode for mode, _ in modes_while_chunking(log)]
    assert modes == [ForwardMode.EXTEND, ForwardMode.DECODE] * (len(modes) // 2) + [ForwardMode.EXTEND]
