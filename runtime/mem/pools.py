"""MemoryPools: the scheduler's view of memory, built the same way for every worker.

The scheduler owns request rows, KV slot numbers and the prefix cache over them;
the KV tensors those slots index belong to the worker (ModelRunner's KVPool).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.mem.allocator import TokenToKVPoolAllocator
from runtime.mem.chunk_cache import ChunkCache
from runtime.mem.prefix_cache import PrefixCache
from runtime.mem.radix_cache import RadixCache
from runtime.mem.req_to_token_pool import ReqToTokenPool


@dataclass(frozen=True, slots=True)
class MemoryPools:
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: PrefixCache
    max_total_num_tokens: int

    @property
    def num_rows(self) -> int:
        return self.req_to_token_pool.size

    @staticmethod
    def rows_for(max_running_requests: int) -> int:
        """Request-pool rows: one spare, which a retracting round may briefly need."""
        return max_running_requests + 1

    @classmethod
    def build(
        cls,
        max_running_requests: int,
        context_len: int,
        max_total_tokens: int,
        page_size: int,
        disable_radix_cache: bool,
        by_role: bool = False,
    ) -> MemoryPools:
        """`by_role`: the radix cache keys tokens with their roles (runtime/token_roles.py)."""
        req_pool = ReqToTokenPool(cls.rows_for(max_running_requests), context_len)
        allocator = TokenToKVPoolAllocator(max_total_tokens, page_size)
        cache = ChunkCache(req_pool, allocator, page_size) if disable_radix_cache else RadixCache(req_pool, allocator, page_size, by_role)
        return cls(req_pool, allocator, cache, max_total_tokens)
