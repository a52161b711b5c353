"""ChunkCache: the prefix cache used with --disable-radix-cache.

Nothing is shared between requests; the cache only carries a chunked request's
already-computed KV from one prefill chunk to the next.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from runtime.mem.allocator import TokenToKVPoolAllocator
    from runtime.mem.req_to_token_pool import ReqToTokenPool
    from runtime.mem.prefix_cache import CacheableReq
    from runtime.mem.prefix_cache import TreeNode

_EMPTY = torch.empty(0, dtype=torch.int64)


class ChunkCache:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size

    def reset(self) -> None:
        pass

    def key(self, req: CacheableReq, tokens: list[int]) -> list[int]:
        return []  # nothing to match

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode | None]:
        return _EMPTY, None

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        pass

    def cache_finished_req(self, req: CacheableReq, kv_len: int) -> None:
        row = req.req_pool_idx
        assert row is not None
        self.allocator.free(self.req_to_token_pool.req_to_token[row, :kv_len].to(torch.int64))
        self.req_to_token_pool.free(row)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_indices = _EMPTY

    def cache_unfinished_req(self, req: CacheableReq) -> bool:
        row = req.req_pool_idx
        assert row is not None
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(req.fill_ids)].to(torch.int64)
        return False  # the row is never rewritten
