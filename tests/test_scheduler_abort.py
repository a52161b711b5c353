"""Aborts at every stage of a request on the stub worker: waiting, mid-chunked-prefill,
decoding (with overlap, right after its next step was launched), abort_all, and a
consumer that goes away. Each ends the request at once with what it had, leaves
the other requests' outputs equal to the oracle, and frees every KV slot and row."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from runtime.engine import Engine
from runtime.model_executor.worker import ModelWorkerBatch
from tests.conftest import assert_all_memory_free
from tests.stub_engine import (
    OVERLAP,
    Output,
    abort_when,
    greedy,
    make_prompts,
    oracle,
    pause_when,
    record_admissions,
    running_in,
    submit,
    track,
)


def launched(engine: Engine, rid: str, after_tokens: int) -> Callable[[ModelWorkerBatch], bool]:
    """A forward of `rid` launched once it has `after_tokens` tokens (0: its prefill)."""

    def cond(mwb: ModelWorkerBatch) -> bool:
        req = running_in(engine, rid, mwb)
        return req is not None and len(req.output_ids) >= after_tokens

    return cond


def assert_aborted_with_nothing(out: Output) -> None:
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["output_ids"] == []


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
async def test_abort_while_waiting_ends_it_before_any_prefill(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(max_running_requests=1, disable_overlap_schedule=overlap)
    admitted = record_admissions(engine)
    a, b = make_prompts([12, 20])
    abort_when(engine, "b", launched(engine, "a", after_tokens=2))  # "b" waits: one row only
    out_a, out_b = await asyncio.gather(submit(engine, "a", a, greedy(16)), submit(engine, "b", b, greedy(16)))
    assert out_a["output_ids"] == oracle(engine, a, 16)
    assert_aborted_with_nothing(out_b)
    assert [r.rid for r in admitted] == ["a"]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("page", [1, 4, 16])
async def test_abort_mid_chunked_prefill_stops_its_chunks_and_frees_them(
    page: int, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(page_size=page, chunked_prefill_size=32, disable_overlap_schedule=overlap)
    short, long = make_prompts([6, 400])
    chunks = track(engine, "long")
    abort_when(engine, "long", lambda _: len(chunks) == 3)  # right after its third chunk launched
    out_short, out_long = await asyncio.gather(
        submit(engine, "short", short, greedy(30)), submit(engine, "long", long, greedy(5))
    )
    assert out_short["output_ids"] == oracle(engine, short, 30)
    assert_aborted_with_nothing(out_long)
    # No chunk of it ran after the third (400 tokens take 13 or more).
    assert len(chunks) == 3 and sum(n for _, _, n in chunks) < len(long)
    assert_all_memory_free(engine)


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("after_tokens", [0, 1, 7], ids=["prefill", "first-decode", "eighth-decode"])
@pytest.mark.parametrize("page", [1, 16])
async def test_abort_right_after_a_launch_keeps_what_was_generated_before(
    page: int, after_tokens: int, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(page_size=page, disable_overlap_schedule=overlap)
    a, b = make_prompts([17, 9])
    abort_when(engine, "a", launched(engine, "a", after_tokens))
    out_a, out_b = await asyncio.gather(submit(engine, "a", a, greedy(100)), submit(engine, "b", b, greedy(40)))
    assert out_a["meta_info"]["finish_reason"]["type"] == "abort"
    # Nothing from the forward it was aborted after reaches the caller; with overlap,
    # neither does the step in flight with it, and their KV slots are freed.
    assert out_a["output_ids"] == oracle(engine, a, after_tokens)
    assert out_b["output_ids"] == oracle(engine, b, 40)
    assert_all_memory_free(engine)


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
async def test_abort_all_ends_running_chunked_and_waiting_requests_and_serving_goes_on(
    overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(max_running_requests=2, chunked_prefill_size=16, page_size=4, disable_overlap_schedule=overlap)
    running, chunked, waiting = make_prompts([8, 300, 10])
    # With "running" decoding and "chunked" mid-prompt, both rows are taken: "waiting" waits.
    chunks = track(engine, "chunked")
    abort_when(engine, None, lambda _: len(chunks) == 3)
    outs = await asyncio.gather(
        submit(engine, "running", running, greedy(200)), submit(engine, "chunked", chunked, greedy(5)),
        submit(engine, "waiting", waiting, greedy(5)),
    )
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3
    assert 0 < len(outs[0]["output_ids"]) < 200 and outs[0]["output_ids"] == oracle(engine, running, len(outs[0]["output_ids"]))
    assert outs[1]["output_ids"] == outs[2]["output_ids"] == [] and len(chunks) == 3
    assert engine.get_server_info()["num_aborted_requests_total"] == 3
    assert_all_memory_free(engine)
    after = await submit(engine, "after", waiting, greedy(5))
    assert after["output_ids"] == oracle(engine, waiting, 5)


async def test_closing_a_stream_aborts_its_request_and_frees_its_memory(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    (prompt,) = make_prompts([25])
    pause = pause_when(engine, launched(engine, "s", after_tokens=1))
    stream = engine.async_generate_stream(prompt, greedy(1000), rid="s")
    first = await anext(stream)
    await stream.aclose()  # the consumer goes away with the request mid-decode
    pause.release.set()
    assert first["meta_info"]["finish_reason"] is None
    assert_all_memory_free(engine)
    info = engine.get_server_info()
    assert info["num_aborted_requests_total"] == 1 and info["generation_tokens_total"] < 1000


async def test_cancelling_a_caller_aborts_its_request_and_frees_its_memory(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    (prompt,) = make_prompts([25])
    pause = pause_when(engine, launched(engine, "c", after_tokens=3))
    caller = asyncio.ensure_future(submit(engine, "c", prompt, greedy(1000)))
    assert await asyncio.to_thread(pause.reached.wait, 30)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    pause.release.set()
    assert_all_memory_free(engine)
    info = engine.get_server_info()
    assert info["num_aborted_requests_total"] == 1 and info["generation_tokens_total"] < 1000
