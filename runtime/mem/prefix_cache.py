"""PrefixCache: the seam between the scheduler and its prefix cache.

RadixCache shares KV between requests; ChunkCache (--disable-radix-cache) only
carries a chunked request's KV from one chunk to the next. The scheduler, the
policy and the batches see either through this protocol alone.
"""

from __future__ import annotations

import itertools
import time
from typing import Protocol

import torch

_ids = itertools.count()


class TreeNode:
    """A node of RadixCache's tree: `key[i]`'s KV lives in slot `value[i]`. Requests
    hold one as `last_node`, the lock handle of their borrowed prefix (None with
    ChunkCache, which shares nothing)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.id = next(_ids)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time


class CacheableReq(Protocol):
    """What a prefix cache reads and rewrites of a request (runtime's Req).

    A running request owns `req_to_token[req_pool_idx, :seq_len]`; the head of
    `prefix_indices` is borrowed from the cache and locked through `last_node`.
    """

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    role_switches: tuple[int, ...]  # (runtime/token_roles.py)
    req_pool_idx: int | None
    prefix_indices: torch.Tensor
    last_node: TreeNode | None


class PrefixCache(Protocol):
    page_size: int

    def reset(self) -> None: ...

    def key(self, req: CacheableReq, tokens: list[int]) -> list[int]:
        """What `match_prefix` takes for `tokens`, a head of the request's prompt + output:
        the tokens, or under deterministic inference, the tokens with their roles."""
        ...

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode | None]:
        """Longest cached page-aligned prefix of `key`: (its KV slots, its last node)."""
        ...

    def evictable_size(self) -> int: ...

    def protected_size(self) -> int: ...

    def total_size(self) -> int: ...

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked slots (fewer if not that many exist)."""
        ...

    def inc_lock_ref(self, node: TreeNode | None) -> None: ...

    def dec_lock_ref(self, node: TreeNode | None) -> None: ...

    def cache_finished_req(self, req: CacheableReq, kv_len: int) -> None:
        """Donate the request's first `kv_len` KV slots to the cache (or free them) and
        release its row. Also used for a retracted request."""
        ...

    def cache_unfinished_req(self, req: CacheableReq) -> bool:
        """After a prefill chunk: cache `fill_ids`' KV and re-borrow it. True if the
        request's row was rewritten (the worker's copy needs a sync)."""
        ...
