"""The `priority` request field on the stub worker: under --schedule-policy priority the
waiting queue runs by priority, then arrival (larger values first, or smaller ones with
--schedule-low-priority-values-first); elsewhere a priority is ignored, or refused with
--abort-on-priority-when-disabled. Every output equals the oracle's, and (the make_stub
fixture checks it after every test) every KV slot and row is free after a flush."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest

from runtime.engine import Engine
from runtime.errors import InvalidRequest
from tests.stub_engine import Output, greedy, make_prompts, oracle, output_ids, prompt_order, record_admissions
from tests.test_trace_app import serving

PRIORITY = dict(schedule_policy="priority")


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


# ---- through the HTTP app (in-process, over the stub engine) ----------------------------------

async def test_over_http_a_priority_is_a_400_where_the_server_refuses_them() -> None:
    async with serving(abort_on_priority_when_disabled=True) as (client, _, _):
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await client.post("/v1/chat/completions", json={**chat, "priority": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "priority" and "--abort-on-priority-when-disabled" in r.json()["error"]["message"]
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
