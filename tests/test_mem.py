"""Allocator and radix cache: the structures the memory invariant rests on."""

from __future__ import annotations

import sys

import pytest
import torch

from runtime.mem.allocator import TokenToKVPoolAllocator
from runtime.mem.kv_pool import KVPool
from runtime.mem.radix_cache import RadixCache
from runtime.mem.req_to_token_pool import ReqToTokenPool
from runtime.managers.req import Req
from runtime.sampling_params import SamplingParams


def test_allocator_never_hands_out_the_dummy_slot_and_returns_everything() -> None:
    alloc = TokenToKVPoolAllocator(size=32, page_size=1)
    slots = alloc.alloc(32)
    assert slots is not None and 0 not in slots.tolist() and len(set(slots.tolist())) == 32
    assert alloc.alloc(1) is None
    alloc.free(slots[:10])
    assert alloc.available_size() == 10
    alloc.free(slots[10:])
    assert alloc.available_size() == 32


def test_paged_allocator_continues_a_partial_page_then_takes_fresh_pages() -> None:
    alloc = TokenToKVPoolAllocator(size=64, page_size=4)
    first = alloc.alloc(6)  # one full page + 2 slots of a second page
    assert first is not None
    assert (first[:4] // 4).unique().numel() == 1 and first[0] % 4 == 0
    more = alloc.alloc_extend(prefix_lens=[6], extend_lens=[5], last_locs=[int(first[-1])])
    assert more is not None and more.numel() == 5
    assert more[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]  # fills the tail page
    assert int(more[2]) % 4 == 0  # then a fresh page
    assert alloc.available_size() == 64 - 4 * 3
    dec = alloc.alloc_decode(seq_lens=[12], last_locs=[int(more[-1])])
    assert dec is not None and int(dec[0]) == int(more[-1]) + 1
    alloc.free(torch.cat([first, more, dec]))
    assert alloc.available_size() == 64


@pytest.mark.parametrize("page_size", [1, 4])
def test_allocator_reuses_freed_slots_before_never_used_ones(page_size: int) -> None:
    # A never-used slot's memory faults on first touch (a whole huge page at once), so a
    # server whose cache was flushed must write its next requests into slots it had used.
    alloc = TokenToKVPoolAllocator(size=256, page_size=page_size)
    first = alloc.alloc(40)
    second = alloc.alloc(40)
    assert first is not None and second is not None
    high_water = int(torch.cat([first, second]).max())
    alloc.free(second)
    alloc.free(first)
    again = alloc.alloc(80)
    assert again is not None and int(again.max()) == high_water
    assert set(again.tolist()) == set(torch.cat([first, second]).tolist())
    beyond = alloc.alloc(8)  # only now the untouched pages, lowest first
    assert beyond is not None and int(beyond.min()) > high_water
    assert beyond.tolist() == sorted(beyond.tolist())


def test_double_free_is_caught() -> None:
    alloc = TokenToKVPoolAllocator(size=8, page_size=1)
    slots = alloc.alloc(8)
    assert slots is not None
    alloc.free(slots)
    alloc.free(slots[:1])
    with pytest.raises(AssertionError):
        alloc.available_size()


def _cache(page_size: int = 1, size: int = 256) -> RadixCache:
    return RadixCache(ReqToTokenPool(8, 128), TokenToKVPoolAllocator(size, page_size), page_size)


def _insert(cache: RadixCache, key: list[int]) -> torch.Tensor:
    value = cache.allocator.alloc(len(key))
    assert value is not None
    prefix = cache.insert(key, value)
    cache.allocator.free(value[:prefix])  # the caller's duplicate copies
    return value


def test_radix_match_splits_a_node_and_returns_the_same_slots() -> None:
    cache = _cache()
    value = _insert(cache, [1, 2, 3, 4, 5])
    got, node = cache.match_prefix([1, 2, 3, 9])
    assert got.tolist() == value[:3].tolist()
    assert node.key == [1, 2, 3] and list(node.children.values())[0].key == [4, 5]
    full, _ = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert full.tolist() == value.tolist()
    assert cache.evictable_size() == 5


def test_radix_insert_reports_the_shared_prefix_and_branches() -> None:
    cache = _cache()
    _insert(cache, [1, 2, 3, 4])
    v = cache.allocator.alloc(5)
    assert v is not None
    assert cache.insert([1, 2, 3, 7, 8], v) == 3
    assert cache.total_size() == 6  # 1,2,3 + 4 + 7,8
    cache.allocator.free(v[:3])


def test_locked_nodes_survive_eviction_and_lru_goes_first() -> None:
    cache = _cache()
    _insert(cache, [1, 2, 3])
    _insert(cache, [7, 8, 9])
    _, locked = cache.match_prefix([7, 8, 9])
    cache.inc_lock_ref(locked)
    assert cache.protected_size() == 3 and cache.evictable_size() == 3
    before = cache.allocator.available_size()
    assert cache.evict(100) == 3
    assert cache.allocator.available_size() == before + 3
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    assert cache.match_prefix([7, 8, 9])[0].numel() == 3
    cache.dec_lock_ref(locked)
    assert cache.evictable_size() == 3 and cache.protected_size() == 0
    cache.evict(3)
    assert cache.allocator.available_size() == 256


def test_evicting_least_recently_used_leaf_first() -> None:
    cache = _cache()
    _insert(cache, [1, 1])
    _insert(cache, [2, 2])
    cache.match_prefix([1, 1])  # touch: [2, 2] is now the older leaf
    cache.evict(1)
    assert cache.match_prefix([1, 1])[0].numel() == 2
    assert cache.match_prefix([2, 2])[0].numel() == 0


def test_paged_radix_keys_are_page_aligned() -> None:
    cache = _cache(page_size=4)
    value = _insert(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    got, _ = cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 9])
    assert got.tolist() == value[:4].tolist()  # a partial page never matches
    got, _ = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert got.numel() == 4


def test_cache_finished_req_donates_kv_and_frees_duplicates_and_row() -> None:
    cache = _cache()
    pool = cache.req_to_token_pool
    existing = _insert(cache, [5, 6, 7])
    req = Req("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=4))
    req.init_next_round_input(cache)
    assert req.prefix_indices.tolist() == existing.tolist()
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = pool.alloc()
    own = cache.allocator.alloc(2)
    assert own is not None
    pool.write(req.req_pool_idx, 0, torch.cat([req.prefix_indices, own]))
    req.output_ids = [9, 10]  # KV exists for 5,6,7,8,9 (the last output has none)
    cache.cache_finished_req(req, kv_len=5)
    assert pool.available_size() == pool.size
    assert cache.protected_size() == 0 and cache.total_size() == 5
    cache.evict(cache.total_size())
    assert cache.allocator.available_size() == 256


def test_a_role_keyed_tree_shares_kv_only_between_tokens_of_one_role() -> None:
    """Deterministic inference computes given text and the model's answers on different
    kernels, so its tree (`by_role`) keys each token with its role: a generated token's KV
    serves a later prompt only where that prompt marks the token as an earlier answer
    (a chat's next turn), never as given text; and a retracted request's recomputed
    outputs are answers too."""
    cache = RadixCache(ReqToTokenPool(8, 128), TokenToKVPoolAllocator(256, 1), 1, by_role=True)
    pool, allocator = cache.req_to_token_pool, cache.allocator

    def start(req: Req) -> torch.Tensor:  # admit: borrow the match, allocate the rest of fill_ids
        req.init_next_round_input(cache)
        cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = pool.alloc()
        own = allocator.alloc(len(req.fill_ids) - len(req.prefix_indices))
        assert req.req_pool_idx is not None and own is not None
        pool.write(req.req_pool_idx, 0, torch.cat([req.prefix_indices, own]))
        return own

    a = Req("a", [1, 2, 3, 4], SamplingParams(max_new_tokens=4))
    start(a)
    a.output_ids = [5, 6]  # KV for 1..5
    extra = allocator.alloc(1)
    assert extra is not None and a.req_pool_idx is not None
    pool.write(a.req_pool_idx, 4, extra)
    cache.cache_finished_req(a, kv_len=5)
    assert cache.total_size() == 5 and allocator.available_size() == 256 - 5

    # The next turn sends a's answer back: as given text it matches the prompt only; with
    # the answer marked, the answer's KV too.
    plain = Req("plain", [1, 2, 3, 4, 5, 7], SamplingParams(max_new_tokens=2))
    plain.init_next_round_input(cache)
    assert len(plain.prefix_indices) == 4
    chat = Req("chat", [1, 2, 3, 4, 5, 7], SamplingParams(max_new_tokens=2), answer_spans=[(4, 5)])
    chat.init_next_round_input(cache)
    assert len(chat.prefix_indices) == 5

    # A retracted request whose tokens another request's prompt (1..7, given text) holds
    # borrows its prompt's part only and recomputes its outputs 4, 5, 6, which enter the
    # tree beside that prompt, as answers.
    _insert(cache, [1, 2, 3, 4, 5, 6, 7])
    c = Req("c", [1, 2, 3], SamplingParams(max_new_tokens=8))
    c.output_ids = [4, 5, 6, 9]
    own = start(c)
    assert len(c.prefix_indices) == 3 and own.numel() == 4
    assert cache.cache_unfinished_req(c) is False
    assert cache.total_size() == 5 + 3 + 4 and len(c.prefix_indices) == 7
    assert cache.key(c, c.fill_ids) == [1, 2, 3, ~4, ~5, ~6, ~9]
    cache.cache_finished_req(c, kv_len=7)
    assert pool.available_size() == pool.size and cache.protected_size() == 0
    cache.evict(cache.total_size())
    assert allocator.available_size() == 256


def _thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")]


def _smaps_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end perms ...
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_the_cpu_kv_pool_is_zeros_per_layer_on_pages_that_may_be_huge() -> None:
    """A CPU pool's buffers start as zeros (padding reads slot 0), each layer's its own, and
    are mapped for 2 MB transparent huge pages where the kernel offers them: a slot's first
    write faults once per 2 MB instead of once per 4 KB (bench/RESULTS.md item 40). Each
    buffer starts at its own offset into a huge page, so the buffers reach their next
    page at different slots and one decode step never faults in all of them (item 41)."""
    pool = KVPool(40_000, 2, 3, 64, torch.float16, "cpu")
    buffers = [*pool.k_buffer, *pool.v_buffer]
    assert all(b.shape == (40_001, 3, 64) and b.dtype == torch.float16 and not b.any() for b in buffers)
    pool.set_kv(1, torch.tensor([7, 39_000]), torch.ones(2, 3, 64), torch.full((2, 3, 64), 2.0))
    assert pool.k_buffer[1][7].eq(1).all() and pool.v_buffer[1][39_000].eq(2).all()
    assert int(pool.k_buffer[1].count_nonzero()) == 2 * 192 and not pool.k_buffer[0].any() and not pool.v_buffer[0].any()
    phases = [b.data_ptr() % (2 << 20) for b in buffers]
    assert len(set(phases)) == len(buffers) and all(p % 4096 == 0 for p in phases)
    if sys.platform != "linux" or _thp_mode() not in ("always", "madvise"):
        return  # no transparent huge pages here: 4 KB pages, as any allocation
    for b in buffers:
        assert _smaps_of(b.data_ptr()).get("THPeligible") == "1"


def _resident(t: torch.Tensor, begin: int, end: int) -> float:
    """The fraction of slots [begin, end)'s 4 KB pages that are mapped (mincore)."""
    import ctypes

    row = t.stride(0) * t.element_size()
    lo, hi = (t.data_ptr() + begin * row) & ~4095, t.data_ptr() + end * row
    pages = (hi - lo + 4095) // 4096
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / pages


def test_a_cpu_kv_pool_maps_its_pages_ahead_of_the_slots_written_keeping_their_contents() -> None:
    """A fresh pool's pages are mapped by a background thread a stretch ahead of the highest
    slot a forward writes, so the worker does not take their first-touch faults (a fresh
    2 MB page cost 3-6 ms on a KVM guest: bench/RESULTS.md item 41); the mapping never
    changes what the slots hold."""
    if sys.platform != "linux":
        pytest.skip("MADV_POPULATE_WRITE is Linux's")
    pool = KVPool(40_000, 30, 3, 64, torch.float16, "cpu")  # SmolLM2's rows: 15 MB a buffer
    pf = pool.prefaulter
    assert pf is not None and pf.wait_idle(timeout=60)
    if pf.stopped:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    buffers = [*pool.k_buffer, *pool.v_buffer]
    first = pf.mapped
    assert 0 < first < 20_000 and all(_resident(b, 0, first) == 1.0 for b in buffers)
    assert all(_resident(b, first + 4096, 40_001) < 0.5 for b in buffers)  # not the whole pool
    loc = torch.tensor([7, 20_000])
    pool.set_kv(1, loc, torch.ones(2, 3, 64), torch.full((2, 3, 64), 2.0))
    pool.note_written(loc)
    assert pf.wait_idle(timeout=60) and pf.mapped == min(40_001, 20_001 + pf.ahead)
    assert all(_resident(b, 0, pf.mapped) == 1.0 for b in buffers)
    assert pool.k_buffer[1][7].eq(1).all() and pool.v_buffer[1][20_000].eq(2).all()
    assert int(pool.k_buffer[1].count_nonzero()) == 2 * 192 and not pool.k_buffer[0].any()
