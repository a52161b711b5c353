"""PrefillAdder budgets and chunking decisions; the order each policy produces."""

from __future__ import annotations

import torch

from runtime.mem.allocator import TokenToKVPoolAllocator
from runtime.mem.radix_cache import RadixCache
from runtime.mem.req_to_token_pool import ReqToTokenPool
from runtime.managers.req import Req
from runtime.sampling_params import SamplingParams
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy


def _setup(size: int = 1024, page_size: int = 1) -> tuple[RadixCache, TokenToKVPoolAllocator, ReqToTokenPool]:
    pool = ReqToTokenPool(16, 2048)
    alloc = TokenToKVPoolAllocator(size, page_size)
    return RadixCache(pool, alloc, page_size), alloc, pool


def _req(n: int, max_new: int = 16, rid: str | None = None, start: int = 100, **kw: object) -> Req:
    r = Req(rid or f"r{n}-{start}", list(range(start, start + n)), SamplingParams(max_new_tokens=max_new), **kw)  # type: ignore[arg-type]
    return r


def _adder(cache: RadixCache, alloc: TokenToKVPoolAllocator, pool: ReqToTokenPool, running: list[Req] | None = None,
           max_prefill: int = 16384, chunk: int | None = None, page: int = 1, ratio: float = 1.0) -> PrefillAdder:
    batch = ScheduleBatch(running or [], pool, alloc, cache)
    return PrefillAdder(page, cache, alloc, batch, ratio, max_prefill, chunk)


def test_prefill_token_budget_stops_the_batch_with_other() -> None:
    cache, alloc, pool = _setup()
    adder = _adder(cache, alloc, pool, max_prefill=100)
    a, b = _req(60), _req(60, start=500)
    for r in (a, b):
        r.init_next_round_input(cache)
    assert adder.add_req(a) == AddReqResult.CONTINUE
    assert adder.add_req(b) == AddReqResult.OTHER
    assert adder.can_run_list == [a]


def test_long_request_is_chunked_to_the_remaining_chunk_budget() -> None:
    cache, alloc, pool = _setup()
    adder = _adder(cache, alloc, pool, chunk=32)
    r = _req(100)
    r.init_next_round_input(cache)
    assert adder.add_req(r) == AddReqResult.OTHER  # chunk budget spent
    assert adder.new_chunked_req is r
    assert r.extend_input_len == 32 and len(r.fill_ids) == 32


def test_chunks_are_page_aligned() -> None:
    cache, alloc, pool = _setup(page_size=16)
    adder = _adder(cache, alloc, pool, chunk=40, page=16)
    r = _req(100)
    r.init_next_round_input(cache)
    adder.add_req(r)
    assert r.extend_input_len == 32


def test_chunked_request_continues_first_and_finishes_untruncated() -> None:
    cache, alloc, pool = _setup()
    r = _req(40)
    r.init_next_round_input(cache)
    r.prefix_indices = torch.arange(1, 33)  # as after its first 32-token chunk
    r.extend_input_len = len(r.fill_ids) - 32
    adder = _adder(cache, alloc, pool, chunk=32)
    assert adder.add_chunked_req(r) is None  # 8 tokens left: the last chunk
    assert adder.can_run_list == [r] and adder.rem_chunk_tokens == 24


def test_kv_budget_counts_what_running_requests_will_still_decode() -> None:
    cache, alloc, pool = _setup(size=200)
    running = _req(10, max_new=100, start=900)
    adder = _adder(cache, alloc, pool, running=[running], ratio=1.0)
    assert adder.rem_total_tokens == 200 - 100
    big = _req(60, max_new=50)
    big.init_next_round_input(cache)
    assert adder.add_req(big) == AddReqResult.NO_TOKEN  # 110 > 100 left
    small = _req(20, max_new=20, start=300)
    small.init_next_round_input(cache)
    assert adder.add_req(small) == AddReqResult.CONTINUE
    assert adder.rem_total_tokens == 200 - 100 - 40


def test_a_request_alone_needs_room_only_for_its_prompt() -> None:
    cache, alloc, pool = _setup(size=100)
    adder = _adder(cache, alloc, pool)
    r = _req(30, max_new=90)
    r.init_next_round_input(cache)
    result = adder.add_req(r)
    assert adder.can_run_list == [r]  # admitted...
    assert result == AddReqResult.NO_TOKEN  # ...and nothing else may join it


def test_cached_prefix_is_excluded_from_the_extend() -> None:
    cache, alloc, pool = _setup()
    slots = alloc.alloc(50)
    assert slots is not None
    cache.insert(list(range(100, 150)), slots)
    r = _req(80)
    r.init_next_round_input(cache)
    assert len(r.prefix_indices) == 50 and r.extend_input_len == 30
    adder = _adder(cache, alloc, pool)
    adder.add_req(r)
    assert adder.log_hit_tokens == 50 and adder.log_input_tokens == 30
    assert cache.protected_size() == 50  # locked while it runs


def _queue() -> list[Req]:
    reqs = [_req(5, max_new=10, start=0, priority=1), _req(5, max_new=30, start=1000, priority=3),
            _req(5, max_new=20, start=2000, priority=2)]
    for i, r in enumerate(reqs):
        r.arrival_time = float(i)
    return reqs


def test_fcfs_keeps_arrival_order_lof_and_priority_reorder() -> None:
    cache, _, _ = _setup()
    q = _queue()
    SchedulePolicy("fcfs", cache).calc_priority(q)
    assert [r.origin_input_ids[0] for r in q] == [0, 1000, 2000]
    SchedulePolicy("lof", cache).calc_priority(q)
    assert [r.sampling_params.max_new_tokens for r in q] == [30, 20, 10]
    q = _queue()
    SchedulePolicy("priority", cache).calc_priority(q)
    assert [r.priority for r in q] == [3, 2, 1]


def test_random_policy_is_a_seeded_permutation() -> None:
    cache, _, _ = _setup()
    q1, q2 = _queue(), _queue()
    SchedulePolicy("random", cache, seed=3).calc_priority(q1)
    SchedulePolicy("random", cache, seed=3).calc_priority(q2)
    assert [r.rid for r in q1] == [r.rid for r in q2]
    assert sorted(r.rid for r in q1) == sorted(r.rid for r in _queue())


def _cache_with(cache: RadixCache, alloc: TokenToKVPoolAllocator, key: list[int]) -> None:
    slots = alloc.alloc(len(key))
    assert slots is not None
    cache.insert(key, slots)


def test_lpm_puts_the_longest_cached_prefix_first() -> None:
    cache, alloc, _ = _setup()
    _cache_with(cache, alloc, list(range(2000, 2004)))
    _cache_with(cache, alloc, list(range(1000, 1005)))
    q = [_req(8, start=0), _req(8, start=2000), _req(8, start=1000)]
    assert SchedulePolicy("lpm", cache).calc_priority(q)
    assert [len(r.prefix_indices) for r in q] == [5, 4, 0]


def test_dfs_weight_runs_requests_sharing_a_prefix_back_to_back() -> None:
    cache, alloc, _ = _setup()
    _cache_with(cache, alloc, [1, 2, 3])
    _cache_with(cache, alloc, [7, 8, 9])
    a1 = Req("a1", [1, 2, 3, 10], SamplingParams())
    b1 = Req("b1", [7, 8, 9, 10], SamplingParams())
    a2 = Req("a2", [1, 2, 3, 11], SamplingParams())
    b2 = Req("b2", [7, 8, 9, 11], SamplingParams())
    a3 = Req("a3", [1, 2, 3, 12], SamplingParams())
    q = [a1, b1, a2, b2, a3]
    SchedulePolicy("dfs-weight", cache).calc_priority(q)
    assert [r.rid for r in q] == ["a1", "a2", "a3", "b1", "b2"]  # heavier subtree first


def test_lpm_defers_a_request_whose_prefix_another_waiting_request_will_compute() -> None:
    cache, alloc, _ = _setup()
    system_a, system_b = list(range(1000, 1040)), list(range(2000, 2040))
    a1, a2 = Req("a1", system_a + [1], SamplingParams()), Req("a2", system_a + [2], SamplingParams())
    b1, short = Req("b1", system_b + [1], SamplingParams()), Req("short", system_a[:8], SamplingParams())
    q = [a1, a2, b1, short]
    SchedulePolicy("lpm", cache).calc_priority(q)
    assert [r.rid for r in q] == ["a1", "b1", "short", "a2"]  # a2 would recompute a1's 40 tokens

    _cache_with(cache, alloc, system_a)  # a1 ran: now a2 hits the cache and goes first
    q = [b1, a2]
    SchedulePolicy("lpm", cache).calc_priority(q)
    assert [r.rid for r in q] == ["a2", "b1"]
