"""Every schedule policy on the stub worker: outputs equal the oracle whatever the
order, and each policy admits waiting requests in the order it promises
(runtime/managers/schedule_policy.py). Order is observed as the order of first
admission to a prefill, with one row (max_running_requests=1) so that requests run
one at a time; the prompts of one `generate` call are all queued before the
scheduler's next decision."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from config.settings import POLICIES
from runtime.engine import Engine
from runtime.managers.req import Req
from tests.stub_engine import (
    generate_all,
    generate_one,
    OVERLAP,
    greedy,
    make_prompt,
    make_prompts,
    oracle,
    output_ids,
    prompt_order,
    record_admissions,
)

ONE_ROW = dict(max_running_requests=1)


@pytest.mark.parametrize("overlap", OVERLAP.values(), ids=OVERLAP.keys())
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_oracles_tokens(policy: str, overlap: bool, make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(schedule_policy=policy, max_running_requests=4, chunked_prefill_size=32, page_size=4,
                       disable_overlap_schedule=overlap)
    shared = make_prompt(40, seed=9)
    prompts = make_prompts([5, 70, 12, 33]) + [shared + [100 + i] for i in range(4)]
    max_new = [10 + 3 * i for i in range(len(prompts))]
    outs = generate_all(engine, prompts, [greedy(n) for n in max_new])
    assert output_ids(outs) == [oracle(engine, p, n) for p, n in zip(prompts, max_new)]


# (policy, settings, admission order of four prompts queued together with
# max_new_tokens 3, 20, 8, 5).
ORDERS = {
    "fcfs": ("fcfs", {}, [0, 1, 2, 3]),  # arrival order
    "lof": ("lof", {}, [1, 2, 3, 0]),  # longest output first
    # Cache-aware policies with no radix cache to match against are fcfs.
    "lpm-no-radix": ("lpm", {"disable_radix_cache": True}, [0, 1, 2, 3]),
    "dfs-weight-no-radix": ("dfs-weight", {"disable_radix_cache": True}, [0, 1, 2, 3]),
}


@pytest.mark.parametrize("case", ORDERS)
def test_admission_order_follows_the_policy(case: str, make_stub: Callable[..., Engine]) -> None:
    policy, settings, order = ORDERS[case]
    engine = make_stub(schedule_policy=policy, **settings, **ONE_ROW)
    admitted = record_admissions(engine)
    prompts = make_prompts([9, 30, 4, 17])
    generate_all(engine, prompts, [greedy(n) for n in (3, 20, 8, 5)])
    assert prompt_order(admitted, prompts) == order


def test_priority_admits_the_highest_priority_first_then_by_arrival(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(schedule_policy="priority", **ONE_ROW)
    admitted = record_admissions(engine)
    prompts = make_prompts([9, 30, 4, 17, 6])
    priorities = [1, 5, 1, 3, 5]
    # Engine.generate takes no priority: set Req.priority as the scheduler receives each.
    by_prompt = {tuple(p): prio for p, prio in zip(prompts, priorities)}
    add_request = engine.scheduler.add_request

    def add_with_priority(req: Req) -> None:
        req.priority = by_prompt[tuple(req.origin_input_ids)]
        add_request(req)

    engine.scheduler.add_request = add_with_priority  # type: ignore[method-assign]
    outs = generate_all(engine, prompts, greedy(6))
    assert prompt_order(admitted, prompts) == [1, 4, 3, 0, 2]
    assert output_ids(outs) == [oracle(engine, p, 6) for p in prompts]


def test_random_order_is_a_permutation_fixed_by_the_seed(make_stub: Callable[..., Engine]) -> None:
    prompts = make_prompts([5] * 8)
    orders = []
    for seed in (1, 1, 2):
        engine = make_stub(schedule_policy="random", random_seed=seed, **ONE_ROW)
        admitted = record_admissions(engine)
        generate_all(engine, prompts, greedy(2))
        orders.append(prompt_order(admitted, prompts))
    assert sorted(orders[0]) == list(range(8))
    assert orders[0] == orders[1] != orders[2]
    assert orders[0] != list(range(8))


def test_lpm_admits_the_longest_cached_prefix_first(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(schedule_policy="lpm", **ONE_ROW)
    cached = make_prompt(60, seed=11)
    generate_one(engine, cached, greedy(2))  # now in the prefix cache
    admitted = record_admissions(engine)
    prompts = [make_prompt(50, seed=12), cached[:10] + make_prompt(40, seed=13), cached[:45] + make_prompt(5, seed=14)]
    outs = generate_all(engine, prompts, greedy(4))
    assert prompt_order(admitted, prompts) == [2, 1, 0]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, 10, 45]


@pytest.mark.parametrize(("policy", "second_hits_cache"), [("lpm", True), ("fcfs", False)])
def test_lpm_holds_back_a_request_whose_prompt_head_an_earlier_one_will_compute(
    policy: str, second_hits_cache: bool, make_stub: Callable[..., Engine]
) -> None:
    head = make_prompt(40, seed=15)
    first, second, other = head + [101], head + [102], make_prompt(41, seed=16)
    # A prefill budget of two prompts: under fcfs the two sharing a head go together
    # and both compute it; lpm sends `other` in its place so `second` reuses `first`'s KV.
    engine = make_stub(schedule_policy=policy, max_prefill_tokens=2 * 41, chunked_prefill_size=-1)
    outs = generate_all(engine, [first, second, other], greedy(5))
    assert output_ids(outs) == [oracle(engine, p, 5) for p in (first, second, other)]
    assert outs[1]["meta_info"]["cached_tokens"] == (40 if second_hits_cache else 0)


def test_dfs_weight_admits_the_subtree_with_most_waiting_requests_first(make_stub: Callable[..., Engine]) -> None:
    engine = make_stub(schedule_policy="dfs-weight", **ONE_ROW)
    p, q = make_prompt(30, seed=17), make_prompt(30, seed=18)
    generate_all(engine, [p, q], greedy(2))  # both in the prefix cache
    admitted = record_admissions(engine)
    # One request under q (the longest match: lpm would take it first), three under p:
    # while p's subtree is the heavier, its requests go first.
    prompts = [q[:25] + [101]] + [p[:20] + [102 + i] for i in range(3)]
    generate_all(engine, prompts, greedy(3))
    assert prompt_order(admitted, prompts)[:2] == [1, 2]
