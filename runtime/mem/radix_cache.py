"""RadixCache: a radix tree over token ids whose nodes own KV slots.

Invariants:
- Every key and value in the tree is a whole number of pages long; a node's
  `value[i]` is the KV slot of `key[i]`.
- A node with `lock_ref > 0` (some running request's prefix ends at or below it)
  is never evicted. `evictable_size` counts tokens in unlocked nodes,
  `protected_size` tokens in locked ones; together they are every slot the tree owns.
- A request borrows the page-aligned head of its `prefix_indices` from the tree
  (locked via `last_node`); what follows it (an unaligned tail shorter than a
  page, then everything computed since) is the request's own.
- With `by_role` (deterministic inference, where a token's KV depends on its role:
  runtime/token_roles.py) a key holds each answer token as `~token`, so a given token
  and the same token written by the model never share a node.
"""

from __future__ import annotations

import heapq
import time
from typing import TYPE_CHECKING

import torch

from runtime.mem.prefix_cache import TreeNode
from runtime.token_roles import role_keyed

if TYPE_CHECKING:
    from runtime.mem.allocator import TokenToKVPoolAllocator
    from runtime.mem.req_to_token_pool import ReqToTokenPool
    from runtime.mem.prefix_cache import CacheableReq

_EMPTY = torch.empty(0, dtype=torch.int64)


class RadixCache:
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator, page_size: int, by_role: bool = False
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.by_role = by_role
        self.reset()

    # ---- tree primitives -------------------------------------------------
    def reset(self) -> None:
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def _child_key(self, key: list[int]) -> object:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after n tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:n], child.value[:n], parent)
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        parent.children[self._child_key(upper.key)] = upper
        return upper

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached page-aligned prefix of `key`: (its KV slots, its last node)."""
        key = key[: len(key) - len(key) % self.page_size]
        node, values, now = self.root, [], time.monotonic()
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, key = child, key[n:]
        return (torch.cat(values) if values else _EMPTY), node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert page-aligned `key` -> `value`; returns how many leading tokens
        were already cached (the caller still owns, and must free, those slots)."""
        node, prefix, now = self.root, 0, time.monotonic()
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            prefix += n
            node, key, value = child, key[n:], value[n:]
        if key:
            leaf = TreeNode(list(key), value.clone(), node)
            node.children[self._child_key(key)] = leaf
            self._evictable += len(key)
        return prefix

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "lock_ref underflow"
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, least recently used first."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            node = heapq.heappop(leaves)
            self.allocator.free(node.value)
            freed += len(node.key)
            self._evictable -= len(node.key)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return freed

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    # ---- request-level operations -----------------------------------------
    def key(self, req: CacheableReq, tokens: list[int]) -> list[int]:
        return role_keyed(tokens, req.role_switches) if self.by_role else tokens

    def _borrowed_len(self, req: CacheableReq) -> int:
        n = len(req.prefix_indices)
        return n - n % self.page_size

    def cache_finished_req(self, req: CacheableReq, kv_len: int) -> None:
        """Donate a finished (or retracted) request's KV to the tree and release its row.

        The first `kv_len` tokens of prompt + output have KV in the request's row.
        """
        row = req.req_pool_idx
        assert row is not None
        kv = self.req_to_token_pool.req_to_token[row, :kv_len].to(torch.int64)
        aligned = kv_len - kv_len % self.page_size
        self.allocator.free(kv[aligned:])
        new_prefix = self.insert(self.key(req, (req.origin_input_ids + req.output_ids)[:aligned]), kv[:aligned])
        # Slots between what the request borrowed and what the tree already had are
        # duplicates of tree-owned KV: the request's copies go back to the allocator.
        self.allocator.free(kv[self._borrowed_len(req) : new_prefix])
        self.req_to_token_pool.free(row)
        self.dec_lock_ref(req.last_node)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_indices = _EMPTY

    def cache_unfinished_req(self, req: CacheableReq) -> bool:
        """After a prefill (or a chunk of one): put the computed `fill_ids` in the
        tree and re-borrow them. Returns True if the request's row was rewritten,
        i.e. some of its own slots duplicated tree KV and were given back.

        Safe while the forward that computes this KV is still in flight: any later
        forward that reads these slots runs after it on the worker."""
        n = len(req.fill_ids)
        row = req.req_pool_idx
        assert row is not None
        kv = self.req_to_token_pool.req_to_token[row, :n].to(torch.int64)
        aligned = n - n % self.page_size
        borrowed = self._borrowed_len(req)
        key = self.key(req, req.fill_ids[:aligned])
        new_prefix = self.insert(key, kv[:aligned])
        self.allocator.free(kv[borrowed:new_prefix])
        new_indices, new_node = self.match_prefix(key)
        assert len(new_indices) == aligned
        if new_prefix > borrowed:
            self.req_to_token_pool.write(row, borrowed, new_indices[borrowed:new_prefix])
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_node)
        # The unaligned tail (if any) stays the request's own.
        req.prefix_indices = torch.cat([new_indices, kv[aligned:]])
        req.last_node = new_node
        return new_prefix > borrowed
