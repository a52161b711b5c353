"""Prompt logprobs (SGLang's input_token_logprobs, #14) through the scheduler, on a stub worker.

The stub scores prompt token i from the tokens it reads back through the KV slots of
positions < i (stub_worker.stub_prompt_logprob), so a prefix taken from the cache past
logprob_start_len, a lost chunk, a wrong row or a stale result gives a wrong value:
`prompt_logprobs_reference` is what every setting must report. make_stub checks after
each test that every KV slot and request row is free again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from runtime.engine import Engine
from runtime.errors import InvalidRequest
from runtime.managers.prompt_logprobs import PromptLogprobs
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.tokenizer_manager import RequestLimits, logprob_start_len
from runtime.model_executor.stub_worker import next_token, prompt_logprobs_reference
from tests.stub_engine import CONFIGS, OVERLAP, generate_all, greedy, make_prompts, oracle, output_ids

VOCAB = 49152


def reference(engine: Engine, prompt: list[int], start: int) -> list[tuple[float | None, int]]:
    return prompt_logprobs_reference(prompt, start, engine.model_config.vocab_size)


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("name", CONFIGS.keys())
def test_prompt_logprobs_equal_the_oracle_in_every_scheduler_setting(name: str, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**CONFIGS[name], disable_overlap_schedule=overlap)
    prompts = make_prompts([50, 7, 33, 20, 1, 12], seed=5)
    starts = [0, 3, 32, -1, 0, 11]  # from the first token, mid-prompt, the last token, none, a 1-token prompt
    max_new = [6, 0, 3, 9, 2, 0]
    outs = generate_all(engine, prompts, [greedy(n) for n in max_new], return_logprob=True, top_logprobs_num=2,
                        logprob_start_len=starts)
    assert output_ids(outs) == [oracle(engine, p, n) for p, n in zip(prompts, max_new)]
    for prompt, start, out in zip(prompts, starts, outs):
        meta = out["meta_info"]
        if start < 0:
            assert "input_token_logprobs" not in meta and "input_top_logprobs" not in meta
            continue
        assert meta["input_token_logprobs"] == reference(engine, prompt, start)
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(prompt) - start and tops[0] is None
        for i, top in enumerate(tops[1:], start=start + 1):  # the stub's top pick after prompt[:i] comes first
            assert [t for _, t in top] == [next_token(prompt[:i], VOCAB), (next_token(prompt[:i], VOCAB) + 1) % VOCAB]
        assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("page", [1, 4])
def test_a_cached_prefix_is_reused_only_up_to_logprob_start_len(page: int, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(page_size=page, disable_overlap_schedule=overlap)
    (prompt,) = make_prompts([40], seed=9)
    generate_all(engine, [prompt], greedy(2))  # the whole prompt is cached now
    out = engine.generate(prompt, greedy(2), return_logprob=True, logprob_start_len=13)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == reference(engine, prompt, 13)
    assert meta["cached_tokens"] <= 13 and meta["cached_tokens"] == 13 - 13 % page
    plain = engine.generate(prompt, greedy(2), return_logprob=True)  # no prompt logprobs: the whole cache
    assert plain["meta_info"]["cached_tokens"] == 39 - 39 % page
    assert "input_token_logprobs" not in plain["meta_info"]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_requests_sharing_a_prefix_each_get_their_own_prompt_logprobs(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    """Same prefix, different tails, in one batch and chunked: the radix cache shares what
    it may (before each one's start) and nothing after."""
    engine = make_stub(chunked_prefill_size=16, page_size=4, disable_overlap_schedule=overlap)
    (head,) = make_prompts([24], seed=2)
    tails = make_prompts([10, 30, 5], seed=3)
    prompts = [head + t for t in tails] + [head]
    starts = [0, 20, 26, 23]
    outs = generate_all(engine, prompts, greedy(3), return_logprob=True, logprob_start_len=starts)
    for prompt, start, out in zip(prompts, starts, outs):
        assert out["meta_info"]["input_token_logprobs"] == reference(engine, prompt, start)
    assert output_ids(outs) == [oracle(engine, p, 3) for p in prompts]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("mixed", [False, True], ids=["plain", "mixed"])
def test_prompt_logprobs_survive_retraction(mixed: bool, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    """A pool too small for every request's decode retracts some (tests/test_scheduler_retract.py's
    setting); a retracted request's re-prefill must neither lose nor duplicate its prompt logprobs."""
    engine = make_stub(max_total_tokens=256, chunked_prefill_size=32, schedule_conservativeness=0.3,
                       enable_mixed_chunk=mixed, page_size=4, disable_overlap_schedule=overlap)
    prompts = make_prompts([10 + (7 * i) % 31 for i in range(16)], seed=5)
    starts = [i % 3 * 4 for i in range(16)]
    outs = generate_all(engine, prompts, greedy(64), return_logprob=True, logprob_start_len=starts)
    assert engine.get_server_info()["num_retracted_reqs_total"] > 0
    assert output_ids(outs) == [oracle(engine, p, 64) for p in prompts]
    for prompt, start, out in zip(prompts, starts, outs):
        assert out["meta_info"]["input_token_logprobs"] == reference(engine, prompt, start)


def test_a_retraction_with_the_prefill_still_in_flight_recomputes_its_prompt_logprobs(
    make_stub: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Overlap: the decode batch built while X's prefill runs retracts X (forced here), so
    that prefill's results are stale when they arrive; X's re-prefill must score its prompt again."""
    engine = make_stub(page_size=4)
    other, scored = make_prompts([9, 30], seed=8)  # the longer prompt is retracted first
    check = ScheduleBatch.check_decode_mem

    def short_of_memory_while_x_prefills(batch: ScheduleBatch) -> bool:
        x = next((r for r in batch.reqs if r.prompt_logprobs is not None), None)
        if x is not None and not x.has_prefilled and x.epoch == 0:
            return False
        return check(batch)

    monkeypatch.setattr(ScheduleBatch, "check_decode_mem", short_of_memory_while_x_prefills)
    outs = generate_all(engine, [other, scored], greedy(5), return_logprob=True, top_logprobs_num=1, logprob_start_len=[-1, 3])
    assert engine.get_server_info()["num_retracted_reqs_total"] == 1
    assert output_ids(outs) == [oracle(engine, other, 5), oracle(engine, scored, 5)]
    assert outs[1]["meta_info"]["input_token_logprobs"] == reference(engine, scored, 3)
    assert len(outs[1]["meta_info"]["input_top_logprobs"]) == 27


def test_a_stream_carries_the_prompt_logprobs_once_in_its_first_chunk(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(chunked_prefill_size=8)
    (prompt,) = make_prompts([30], seed=6)

    async def run() -> list[dict[str, Any]]:
        stream = engine.async_generate_stream(prompt, greedy(4), return_logprob=True, top_logprobs_num=1, logprob_start_len=5)
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert [c["meta_info"]["input_token_logprobs"] for c in chunks] == [reference(engine, prompt, 5)] + [[]] * 3
    assert [len(c["meta_info"]["input_top_logprobs"]) for c in chunks] == [25, 0, 0, 0]


def test_bad_logprob_start_len_is_refused_before_queueing(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    (prompt,) = make_prompts([8], seed=1)
    for bad in (8, 100, -2):
        with pytest.raises(InvalidRequest) as info:
            engine.generate(prompt, greedy(1), return_logprob=True, logprob_start_len=bad)
        assert info.value.param == "logprob_start_len"
    with pytest.raises(InvalidRequest) as info:
        engine.generate(prompt, greedy(1), top_logprobs_num=21, logprob_start_len=0)
    assert info.value.param == "top_logprobs"
    # Without return_logprob it is ignored, as SGLang does.
    assert "input_token_logprobs" not in engine.generate(prompt, greedy(1), logprob_start_len=100)["meta_info"]
    assert engine.get_server_info()["num_requests_total"] == 1


def test_prefill_disaggregation_refuses_prompt_logprobs_and_prefill_only_requests() -> None:
    limits = RequestLimits(64, VOCAB, 64, (), torch.device("cpu"), disaggregation_mode="prefill")
    assert logprob_start_len(-1, 8, 1, limits) == -1
    for start, max_new, param in ((0, 1, "logprob_start_len"), (-1, 0, "max_new_tokens")):
        with pytest.raises(InvalidRequest) as info:
            logprob_start_len(start, 8, max_new, limits)
        assert info.value.param == param


def test_a_retraction_rewinds_to_the_results_that_arrived() -> None:
    lp = PromptLogprobs(start=2, prompt_len=20, top_k=0)
    assert lp.schedule(0, 8) == (2, 6) and lp.prefix_limit() == 8
    assert lp.schedule(8, 8) == (0, 8) and lp.prefix_limit() == 16
    lp.values.extend([-1.0] * 6)  # the first batch's results arrived; the second's are stale
    lp.rewind()
    assert lp.prefix_limit() == 8 and not lp.complete
    assert lp.schedule(8, 12) == (0, 11) and lp.prefix_limit() is None
    lp.values.extend([-2.0] * 11)
    assert lp.complete
    entries, tops = lp.take(list(range(20)))
    assert entries == [(None, 2)] + [(-1.0, t) for t in range(3, 9)] + [(-2.0, t) for t in range(9, 20)] and tops == []
    assert lp.take(list(range(20))) == ([], [])  # once


def test_the_prompt_rows_reach_the_other_tensor_parallel_ranks() -> None:
    """Every rank projects the same rows (their all-gathers pair up): the rows travel in the
    forward's broadcast payload."""
    from runtime.model_executor import tp_channel
    from runtime.model_executor.forward_batch import ForwardMode
    from runtime.model_executor.worker import ForwardInputs

    inputs = ForwardInputs(
        forward_mode=ForwardMode.EXTEND, input_ids=torch.arange(6), out_cache_loc=torch.arange(1, 7),
        req_pool_indices=[0, 1], seq_lens=[4, 3], extend_prefix_lens=[1, 0], extend_seq_lens=[3, 3],
        prefix_slots=[torch.tensor([9]), torch.empty(0, dtype=torch.int64)], row_syncs=[(1, torch.tensor([5, 6]))],
        prompt_logprob_rows=[0, 1, 4],
    )
    decoded = tp_channel.decode(*tp_channel.encode(inputs, inputs.input_ids))
    assert decoded.prompt_logprob_rows == [0, 1, 4]
    assert decoded.row_syncs[0][1].tolist() == [5, 6] and decoded.extend_seq_lens == [3, 3]
    inputs.prompt_logprob_rows = []
    assert tp_channel.decode(*tp_channel.encode(inputs, inputs.input_ids)).prompt_logprob_rows == []
