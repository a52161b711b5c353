"""PrefixCache: the seam between the scheduler and its prefix cache.

RadixCache shares KV between requests; ChunkCache (--disable-radix-cache) only
carries a chunked request's KV from one chunk to the next. The scheduler, the
policy and the batches see either through this protocol alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from runtime.mem.radix_cache import TreeNode


class CacheableReq(Protocol):
    """What a prefix cache reads and rewrites of a request (runtime's Req).

    A running request owns `req_to_token[req_pool_idx, :seq_len]`; the head of
    `prefix_indices` is borrowed from the cache and locked through `last_node`.
    """

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    req_pool_idx: int | None
    prefix_indices: torch.Tensor
    last_node: TreeNode | None


class PrefixCache(Protocol):
    page_size: int

    def reset(self) -> None: ...

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
