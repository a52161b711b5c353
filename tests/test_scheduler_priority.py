"""The `priority` request field on the stub worker: under --schedule-policy priority the
waiting queue runs by priority, then arrival; with --enable-priority-preemption a request
that lacks KV or a running slot retracts running requests of strictly lower priority
(runtime/managers/priority.py). Whatever is preempted, every output equals the oracle's,
and (the make_stub fixture checks it after every test) every KV slot and row is free
after a flush.

A preemption needs low-priority requests already running when the high-priority one
arrives: `Late` submits it on the scheduler's loop right after a chosen forward is
launched, so the moment is exact, with no sleep."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from collections.abc import Callable
from typing import Any, cast

import httpx
import pytest

from config.settings import EngineSettings, SettingsError
from runtime.engine import Engine
from runtime.errors import InvalidRequest
from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.worker import ModelWorkerBatch
from tests.stub_engine import (
    OVERLAP,
    Output,
    finish_types,
    greedy,
    make_prompts,
    on_launch,
    oracle,
    output_ids,
    prompt_order,
    record_admissions,
    running_in,
)
from tests.test_trace_app import serving

PRIORITY = dict(schedule_policy="priority")
PREEMPT = dict(schedule_policy="priority", enable_priority_preemption=True)
TWO_ROWS = dict(max_running_requests=2)
# A KV pool two long decodes fill: the third request lacks KV, not a row.
TIGHT_KV = dict(max_total_tokens=192, max_running_requests=8)
LOW_NEW, HIGH_NEW = 60, 12


def submit_now(engine: Engine, prompt: list[int], params: dict[str, Any], rid: str,
               priority: int | None) -> concurrent.futures.Future[Output]:
    """Called on the scheduler's loop: the request is queued before the round after this one
    is built (its task registers it at the round's first await). Returns its output."""
    out: concurrent.futures.Future[Output] = concurrent.futures.Future()
    task = asyncio.ensure_future(engine.async_generate(prompt, params, rid=rid, priority=priority))
    task.add_done_callback(lambda t: out.set_exception(t.exception()) if t.exception() else out.set_result(t.result()))  # type: ignore[arg-type]
    return out


class Late:
    """A request submitted on the scheduler's loop right after the first launch for which
    `cond` holds (so the next round already sees it waiting); `result()` is its output."""

    def __init__(self, engine: Engine, cond: Callable[[ModelWorkerBatch], bool], prompt: list[int],
                 params: dict[str, Any], rid: str, priority: int | None) -> None:
        self.future: concurrent.futures.Future[Output] | None = None

        def hook(mwb: ModelWorkerBatch) -> bool:
            if not cond(mwb):
                return False
            self.future = submit_now(engine, prompt, params, rid, priority)
            return True

        on_launch(engine, hook)

    def result(self) -> Output:
        assert self.future is not None, "the request was never submitted"
        return self.future.result(timeout=60)


def decoding(n: int) -> Callable[[ModelWorkerBatch], bool]:
    """A decode of n requests: the low-priority ones are all running."""
    return lambda mwb: mwb.forward_mode == ForwardMode.DECODE and len(mwb.req_pool_indices) == n


def events(engine: Engine, rid: str, name: str) -> list[dict[str, Any]]:
    trace = engine.get_trace(rid)
    assert trace is not None
    return [e for e in trace["events"] if e["event"] == name]


def prefilled(engine: Engine) -> Callable[[ModelWorkerBatch], bool]:
    """The prefill that ends the last waiting prompt: with overlap, the next round sees
    those requests running while that forward is still in flight."""
    s = engine.scheduler
    return lambda mwb: mwb.forward_mode.is_extend() and not s.waiting_queue and s.chunked_req is None


def run_low_then_high(engine: Engine, low_priorities: list[int], high_priority: int | None,
                      prompt_lens: tuple[int, int] = (20, 24), high_new: int = HIGH_NEW, when: str = "decoding",
                      ) -> tuple[list[Output], Output, list[list[int]], list[int]]:
    """Low-priority requests run; a high-priority one ("high") arrives right after their
    prefill or first decode is launched (`when`). Asserts every output equals the oracle's;
    returns (low outputs, high output, low prompts, high prompt)."""
    lows = make_prompts([prompt_lens[0]] * len(low_priorities), seed=3)
    (high,) = make_prompts([prompt_lens[1]], seed=4)
    trigger = decoding(len(lows)) if when == "decoding" else prefilled(engine)
    late = Late(engine, trigger, high, greedy(high_new), "high", high_priority)
    outs = [cast(Output, o) for o in engine.generate(lows, greedy(LOW_NEW), priority=low_priorities)]
    high_out = late.result()
    assert output_ids(outs) == [oracle(engine, p, LOW_NEW) for p in lows]
    assert high_out["output_ids"] == oracle(engine, high, high_new)
    assert finish_types([*outs, high_out]) == ["length"] * (len(lows) + 1)
    return outs, high_out, lows, high


def preempted_count(engine: Engine) -> int:
    return int(engine.get_server_info()["num_preempted_reqs_total"])


def preempted_rids(engine: Engine) -> list[str]:
    """The finished requests that were preempted at least once."""
    return [t.rid for t in engine.scheduler.traces.recent(10_000) if any(e[0] == "preempted" for e in t.events)]


# ---- the order of the waiting queue -----------------------------------------------------

@pytest.mark.parametrize("low_first", [False, True], ids=["high-values-first", "low-values-first"])
def test_the_waiting_queue_runs_by_priority_then_arrival(low_first: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**PRIORITY, schedule_low_priority_values_first=low_first, max_running_requests=1)
    admitted = record_admissions(engine)
    prompts = make_prompts([9, 30, 4, 17, 6, 11])
    priorities: list[int | None] = [1, 5, 1, 3, 5, None]  # None: the default, 0
    outs = engine.generate(prompts, greedy(6), priority=priorities)  # type: ignore[arg-type]
    assert output_ids(cast(list[Output], outs)) == [oracle(engine, p, 6) for p in prompts]
    assert prompt_order(admitted, prompts) == ([5, 0, 2, 3, 1, 4] if low_first else [1, 4, 3, 0, 2, 5])


def test_under_another_policy_priority_is_accepted_and_ignored(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(schedule_policy="fcfs", max_running_requests=1)
    admitted = record_admissions(engine)
    prompts = make_prompts([9, 30, 4])
    engine.generate(prompts, greedy(3), priority=[0, 9, 5])
    assert prompt_order(admitted, prompts) == [0, 1, 2]


# ---- preemption ------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("when", ["prefilled", "decoding"])
@pytest.mark.parametrize("enabled", [True, False], ids=["preemption", "no-preemption"])
def test_a_higher_priority_request_takes_a_running_slot_only_with_preemption_on(
    enabled: bool, when: str, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(**(PREEMPT if enabled else PRIORITY), **TWO_ROWS, disable_overlap_schedule=overlap)
    run_low_then_high(engine, [0, 1], 5, when=when)
    victims = preempted_rids(engine)
    if enabled:
        assert preempted_count(engine) == 1
        (victim,) = victims
        (mark,) = events(engine, victim, "preempted")
        assert (mark["by"], mark["priority"]) == ("high", 0)  # the lowest priority goes first
        # The high one ran ahead: it finished before the request it preempted.
        assert engine.get_trace("high")["e2e"] < engine.get_trace(victim)["e2e"]  # type: ignore[index]
    else:
        assert preempted_count(engine) == 0 and not victims


@pytest.mark.parametrize("high, threshold, preempts", [
    (0, 0, False),  # equal priority: never
    (None, 0, False),  # no priority is 0
    (1, 0, True),
    (3, 3, False),  # the gap must exceed the threshold
    (4, 3, True),
])
def test_only_priorities_lower_by_more_than_the_threshold_are_preempted(
    high: int | None, threshold: int, preempts: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(**PREEMPT, **TWO_ROWS, priority_scheduling_preemption_threshold=threshold)
    run_low_then_high(engine, [0, 0], high)
    assert preempted_count(engine) == (1 if preempts else 0)


def test_with_low_values_first_a_smaller_value_preempts(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**PREEMPT, **TWO_ROWS, schedule_low_priority_values_first=True)
    run_low_then_high(engine, [0, 2], -1)
    (victim,) = preempted_rids(engine)
    assert events(engine, victim, "preempted")[0]["priority"] == 2  # the largest value ranks lowest


KV_VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "page4": {"page_size": 4},
    "chunk16": {"chunked_prefill_size": 16},
    "page4-chunk8": {"page_size": 4, "chunked_prefill_size": 8},
    "mixed-chunk16": {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
    "no-radix": {"disable_radix_cache": True},
}


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("when", ["prefilled", "decoding"])
@pytest.mark.parametrize("variant", KV_VARIANTS)
def test_a_request_short_of_kv_preempts_and_every_output_equals_the_oracle(
    variant: str, when: str, overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(**PREEMPT, **TIGHT_KV, **KV_VARIANTS[variant], disable_overlap_schedule=overlap)
    outs, _, _, _ = run_low_then_high(engine, [0, 0], 1, prompt_lens=(30, 40), when=when)
    assert preempted_count(engine) >= 1
    for out in outs:  # a preempted request re-prefilled: its stream still counts every token once
        assert out["meta_info"]["completion_tokens"] == LOW_NEW


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_a_preempted_request_is_not_readmitted_ahead_of_the_one_it_made_room_for(
    overlap: bool, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(**PREEMPT, **TWO_ROWS, disable_overlap_schedule=overlap)
    run_low_then_high(engine, [0, 0], 1)
    (victim,) = preempted_rids(engine)
    (preempted,) = events(engine, victim, "preempted")
    readmitted = [e for e in events(engine, victim, "prefill_chunk") if e["t"] > preempted["t"]]
    high = engine.get_trace("high")
    assert high is not None and readmitted
    high_first_token = next(e for e in high["events"] if e["event"] == "first_token")
    # Same clock: both traces' `t` count from their own arrival.
    assert readmitted[0]["t"] + engine.get_trace(victim)["arrival_time"] > high_first_token["t"] + high["arrival_time"]  # type: ignore[index]
    assert preempted_count(engine) == 1  # and it was not preempted again


def test_many_high_priority_arrivals_preempt_each_low_one_at_most_once(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**PREEMPT, max_running_requests=3)
    lows = make_prompts([20, 22, 24], seed=7)
    highs = make_prompts([10, 12, 14], seed=8)
    futures: list[concurrent.futures.Future[Output]] = []

    def hook(mwb: ModelWorkerBatch) -> bool:
        if not decoding(3)(mwb):
            return False
        futures.extend(submit_now(engine, p, greedy(HIGH_NEW), f"high{i}", 9) for i, p in enumerate(highs))
        return True

    on_launch(engine, hook)
    outs = cast(list[Output], engine.generate(lows, greedy(LOW_NEW), priority=[0, 0, 0]))
    assert output_ids(outs) == [oracle(engine, p, LOW_NEW) for p in lows]
    assert [f.result(60)["output_ids"] for f in futures] == [oracle(engine, p, HIGH_NEW) for p in highs]
    assert preempted_count(engine) == 3
    for rid in preempted_rids(engine):
        assert len(events(engine, rid, "preempted")) == 1


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_a_request_mid_chunked_prefill_is_not_preempted(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    """The chunked request is not in the running batch: a request of higher priority waits
    for its prompt (or preempts it only once it decodes)."""
    engine = make_stub(**PREEMPT, **TWO_ROWS, chunked_prefill_size=16, disable_overlap_schedule=overlap)
    (long_low, short_low) = make_prompts([120, 10], seed=9)
    (high,) = make_prompts([12], seed=10)
    chunked = engine.scheduler.prefill
    late = Late(engine, lambda mwb: chunked.chunked_req is not None and chunked.chunked_req.rid == "long",
                high, greedy(HIGH_NEW), "high", 5)
    loop = engine._ensure_started()
    lows = [asyncio.run_coroutine_threadsafe(engine.async_generate(p, greedy(LOW_NEW), rid=rid, priority=0), loop)
            for rid, p in (("short", short_low), ("long", long_low))]
    assert [f.result(60)["output_ids"] for f in lows] == [oracle(engine, p, LOW_NEW) for p in (short_low, long_low)]
    assert late.result()["output_ids"] == oracle(engine, high, HIGH_NEW)
    trace = engine.get_trace("long")
    assert trace is not None
    names = [e["event"] for e in trace["events"]]
    if "preempted" in names:  # only after its prompt was done
        assert names.index("preempted") > names.index("prefilled")


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
def test_aborting_a_preempted_request_frees_everything(overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**PREEMPT, **TWO_ROWS, disable_overlap_schedule=overlap)
    lows = make_prompts([20, 24], seed=3)
    (high,) = make_prompts([24], seed=4)
    late = Late(engine, decoding(2), high, greedy(HIGH_NEW), "high", 5)

    def abort_the_victim(mwb: ModelWorkerBatch) -> bool:
        if running_in(engine, "high", mwb) is None:  # the round that preempted admitted it
            return False
        for rid in ("low0", "low1"):
            if events_of(engine, rid, "preempted"):
                engine.scheduler.abort(rid)  # it waits: it ends now
        return True

    on_launch(engine, abort_the_victim)
    loop = engine._ensure_started()
    futures = [asyncio.run_coroutine_threadsafe(
        engine.async_generate(p, greedy(LOW_NEW), rid=f"low{i}", priority=0), loop) for i, p in enumerate(lows)]
    outs = [f.result(60) for f in futures]
    assert late.result()["output_ids"] == oracle(engine, high, HIGH_NEW)
    assert preempted_count(engine) == 1
    assert sorted(finish_types(outs)) == ["abort", "length"]
    for out, prompt in zip(outs, lows):
        assert out["output_ids"] == oracle(engine, prompt, LOW_NEW)[: len(out["output_ids"])]


def events_of(engine: Engine, rid: str, name: str) -> list[Any]:
    """Records `name` of a live or finished request (no JSON round trip)."""
    req = engine.scheduler.reqs_by_rid.get(rid)
    trace = req.trace if req is not None else engine.scheduler.traces.get(rid)
    return [] if trace is None else [e for e in trace.events if e[0] == name]


def test_a_decode_round_short_of_kv_retracts_lower_priorities_first(make_stub: Callable[..., Engine]) -> None:
    """Without preemption, an optimistic admission lets the high-priority request in beside
    the low ones; when the pool runs out mid-decode, a low one goes back, not the newcomer
    (which has the fewest outputs, the one the priority-blind order would pick)."""
    engine = make_stub(**PRIORITY, max_total_tokens=192, schedule_conservativeness=0.3)
    run_low_then_high(engine, [0, 0], 1, prompt_lens=(30, 40), high_new=50)
    assert engine.get_server_info()["num_retracted_reqs_total"] >= 1
    assert not events(engine, "high", "retracted") and preempted_count(engine) == 0


# ---- what a request or the settings may say ----------------------------------------------

@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, True, "3", 1.5])
def test_a_priority_that_is_no_int32_is_refused_before_queueing(bad: object, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(**PRIORITY)
    (prompt,) = make_prompts([5])
    with pytest.raises(InvalidRequest) as err:
        engine.generate(prompt, greedy(2), priority=bad)  # type: ignore[arg-type]
    assert err.value.param == "priority" and "[-2**31, 2**31 - 1]" in str(err.value)
    assert engine.get_server_info()["num_requests_total"] == 0


def test_abort_on_priority_when_disabled_refuses_a_priority_unless_the_policy_is_priority(
    make_stub: Callable[..., Engine]
) -> None:
    (prompt,) = make_prompts([5])
    refusing = make_stub(abort_on_priority_when_disabled=True)
    with pytest.raises(InvalidRequest, match="priority") as err:
        refusing.generate(prompt, greedy(2), priority=0)
    assert err.value.param == "priority"
    assert refusing.generate(prompt, greedy(2))["output_ids"] == oracle(refusing, prompt, 2)  # type: ignore[index]
    accepting = make_stub(**PRIORITY, abort_on_priority_when_disabled=True)
    assert accepting.generate(prompt, greedy(2), priority=3)["output_ids"] == oracle(accepting, prompt, 2)  # type: ignore[index]


def test_preemption_settings_are_validated() -> None:
    with pytest.raises(SettingsError, match="schedule_policy=priority"):
        EngineSettings(enable_priority_preemption=True)
    with pytest.raises(SettingsError, match="priority_scheduling_preemption_threshold"):
        EngineSettings(schedule_policy="priority", priority_scheduling_preemption_threshold=-1)
    EngineSettings(**PREEMPT, priority_scheduling_preemption_threshold=10)


# ---- through the HTTP app (in-process, over the stub engine) ----------------------------------

async def test_over_http_a_high_priority_request_preempts_a_low_one_and_says_so() -> None:
    async with serving(**PREEMPT, **TWO_ROWS) as (client, engine, _):
        lows = make_prompts([20, 24], seed=3)
        (high,) = make_prompts([16], seed=4)
        late: list[asyncio.Task[httpx.Response]] = []

        def post(prompt: list[int], rid: str, priority: int, max_new: int) -> asyncio.Task[httpx.Response]:
            body = {"input_ids": prompt, "rid": rid, "priority": priority, "sampling_params": greedy(max_new)}
            return asyncio.ensure_future(client.post("/generate", json=body))

        def high_arrives(mwb: ModelWorkerBatch) -> bool:
            if decoding(2)(mwb):
                late.append(post(high, "high", 5, HIGH_NEW))
            return bool(late)

        on_launch(engine, high_arrives)
        low_answers = await asyncio.gather(*(post(p, f"low{i}", 0, LOW_NEW) for i, p in enumerate(lows)))
        high_answer = await late[0]
        assert [r.json()["output_ids"] for r in low_answers] == [oracle(engine, p, LOW_NEW) for p in lows]
        assert high_answer.json()["output_ids"] == oracle(engine, high, HIGH_NEW)

        marks = [e for i in range(2) for e in (await client.get(f"/v1/requests/low{i}/trace")).json()["events"]
                 if e["event"] == "preempted"]
        assert [(m["by"], m["priority"]) for m in marks] == [("high", 0)]
        metrics = (await client.get("/metrics")).text
        assert re.search(r"^sluice:num_preempted_reqs_total\{[^}]*\} 1\.0$", metrics, re.M), metrics


async def test_over_http_a_priority_is_a_400_where_the_server_refuses_them() -> None:
    async with serving(abort_on_priority_when_disabled=True) as (client, _, _):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await client.post("/v1/chat/completions", json={**chat, "priority": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "priority" and "--abort-on-priority-when-disabled" in r.json()["error"]["message"]
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
