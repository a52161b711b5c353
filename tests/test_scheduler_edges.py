"""Edges of a request's life on the stub worker: max_new_tokens 0 (refused) and 1, stop token
ids (and EOS, and min_new_tokens deferring them), one-token prompts, a request as
large as the pool admits, and logprobs that stay aligned with their tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from runtime.engine import Engine
from runtime.errors import InvalidRequest
from runtime.token_roles import Span, TokenPrompt
from runtime.model_executor.stub_worker import next_token
from tests.stub_engine import (
    CONFIGS,
    OVERLAP,
    finish_types,
    generate_all,
    generate_one,
    greedy,
    make_prompt,
    make_prompts,
    oracle,
    output_ids,
    record_forwards,
)
from runtime.model_executor.forward_batch import ForwardMode

EDGE_CONFIGS = ["default", "page4-chunk10", "mixed-chunk16", "page16"]


def test_a_negative_max_new_tokens_is_rejected_before_queueing(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    (prompt,) = make_prompts([7])
    with pytest.raises(InvalidRequest):
        generate_one(engine, prompt, greedy(-1))
    assert engine.num_waiting_reqs == 0 and engine.get_server_info()["num_requests_total"] == 0


@pytest.mark.parametrize("spans", [((3, 3),), ((4, 6), (5, 7)), ((0, 8),), ((2, 1),), ((1, 2, 3),)])
def test_bad_answer_spans_are_rejected_before_queueing(make_stub: Callable[..., Engine], spans: tuple[Span, ...]) -> None:
    """Empty, overlapping, past the prompt, reversed, or not pairs: InvalidRequest (a 400)."""
    engine = make_stub()
    (prompt,) = make_prompts([7])
    with pytest.raises(InvalidRequest) as err:
        engine.generate(TokenPrompt(prompt, spans), greedy(2))
    assert err.value.param == "answer_spans"
    assert engine.num_waiting_reqs == 0 and engine.get_server_info()["num_requests_total"] == 0
    assert len(engine.generate(TokenPrompt(prompt, ((1, 3), (3, 7))), greedy(2))["output_ids"]) == 2  # spans may touch


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_max_new_tokens_0_is_a_prefill_with_no_token(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    """SGLang's prefill-only request (prompt logprobs): it ends after its prefill, with no
    output token, beside requests that go on decoding (make_stub checks every slot is free)."""
    engine = make_stub(disable_overlap_schedule=overlap, chunked_prefill_size=16)
    prompts = make_prompts([1, 5, 30, 9])
    outs = generate_all(engine, prompts, [greedy(0), greedy(0), greedy(0), greedy(6)])
    assert output_ids(outs) == [[], [], [], oracle(engine, prompts[3], 6)]
    assert [o["meta_info"]["finish_reason"] for o in outs[:3]] == [{"type": "length", "matched": 0}] * 3
    assert engine.get_server_info()["generation_tokens_total"] == 6


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_max_new_tokens_1_is_the_prefills_token_with_no_decode_step(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(disable_overlap_schedule=overlap)
    prompts = make_prompts([1, 5, 30])
    outs = generate_all(engine, prompts, greedy(1))
    assert output_ids(outs) == [oracle(engine, p, 1) for p in prompts]
    assert [o["meta_info"]["finish_reason"] for o in outs] == [{"type": "length", "matched": 1}] * 3
    assert engine.scheduler.stats.decode_steps == 0


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("name", EDGE_CONFIGS)
def test_each_request_stops_at_its_own_stop_token_id(name: str, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**CONFIGS[name], disable_overlap_schedule=overlap)
    prompts = make_prompts([4, 33, 12, 70, 1])
    full = [oracle(engine, p, 40) for p in prompts]
    stops = [ids[k] for ids, k in zip(full, (0, 3, 6, 9, 12))]  # from the first token on
    outs = generate_all(engine, prompts, [greedy(40, stop_token_ids=[s]) for s in stops])
    assert output_ids(outs) == [oracle(engine, p, 40, stop_ids=[s]) for p, s in zip(prompts, stops)]
    assert [o["meta_info"]["finish_reason"] for o in outs] == [{"type": "stop", "matched": s} for s in stops]


def test_min_new_tokens_defers_a_stop_token_id(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub()
    (prompt,) = make_prompts([10])
    full = oracle(engine, prompt, 30)
    stops, min_new = [full[2], full[8]], 5
    # The stop at token 3 comes before min_new_tokens and does not count.
    end = next(j for j in range(min_new - 1, 30) if full[j] in stops)
    out = generate_one(engine, prompt, greedy(30, stop_token_ids=stops, min_new_tokens=min_new))
    assert out["output_ids"] == full[: end + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[end]}


def prompt_answered_by(token: int, vocab_size: int) -> list[int]:
    """A prompt whose first generated token is `token`."""
    base = make_prompt(6, seed=31)
    last = next(t for t in range(vocab_size) if next_token(base + [t], vocab_size) == token)
    return base + [last]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_eos_ends_a_request_unless_ignore_eos(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(disable_overlap_schedule=overlap)
    (eos,) = engine.model_config.eos_token_ids
    prompt = prompt_answered_by(eos, engine.model_config.vocab_size)
    stopped, ignored = generate_all(engine, [prompt, prompt], [greedy(10, ignore_eos=False), greedy(10)])
    assert stopped["output_ids"] == [eos] and stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert ignored["output_ids"] == oracle(engine, prompt, 10) and ignored["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("page", [1, 4, 16])
def test_a_request_as_large_as_the_pool_admits_runs_alone_to_the_end(page: int, make_stub: Callable[..., Engine]) -> None:
    pool = 256
    engine = make_stub(page_size=page, max_total_tokens=pool, chunked_prefill_size=64)
    (prompt,) = make_prompts([150], seed=32)
    max_new = pool - page - len(prompt)  # admission's limit
    outs = generate_all(engine, [prompt, prompt[:20]], [greedy(max_new), greedy(30)])
    assert output_ids(outs) == [oracle(engine, prompt, max_new), oracle(engine, prompt[:20], 30)]
    assert finish_types(outs) == ["length", "length"]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_a_row_freed_by_a_finished_request_is_refilled_while_others_still_run(
    overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    """A full batch that loses a request admits the next waiting one at once, not
    only once the whole batch has drained."""
    engine = make_stub(max_running_requests=2, disable_overlap_schedule=overlap)
    forwards = record_forwards(engine)
    prompts = make_prompts([8, 8, 8], seed=12)
    outs = generate_all(engine, prompts, [greedy(n) for n in (2, 30, 2)])
    assert output_ids(outs) == [oracle(engine, p, n) for p, n in zip(prompts, (2, 30, 2))]
    extends = [i for i, f in enumerate(forwards) if f.forward_mode == ForwardMode.EXTEND]
    assert len(extends) == 2 and extends[1] <= 3, [f.forward_mode.name for f in forwards]


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("name", ["chunk16", "mixed-chunk16"])
def test_logprobs_stay_aligned_with_their_tokens(name: str, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**CONFIGS[name], disable_overlap_schedule=overlap)
    prompts = make_prompts([3, 50, 20])
    outs = generate_all(engine, prompts, [greedy(n) for n in (12, 5, 9)], return_logprob=True, top_logprobs_num=2)
    for out in outs:
        meta = out["meta_info"]
        assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]
        assert [top[0][1] for top in meta["output_top_logprobs"]] == out["output_ids"]
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_an_invalid_prompt_in_a_batch_ends_its_siblings_too(make_stub: Callable[..., Engine]) -> None:
    """generate() raises for the batch; the valid requests must not run on unseen."""
    engine = make_stub()
    prompts = make_prompts([8, 8], seed=11)
    with pytest.raises(InvalidRequest):
        engine.generate(prompts, [greedy(300), {"max_new_tokens": -1}])
    assert engine.wait_idle(10), "a sibling of the invalid request kept running"
    assert engine.get_server_info()["num_running_reqs"] == 0
