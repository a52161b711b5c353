"""SchedulePolicy (waiting-queue order) and PrefillAdder (what fits in one prefill)."""

from __future__ import annotations

import enum
import random
from typing import TYPE_CHECKING

from runtime.mem.prefix_cache import PrefixCache
from runtime.mem.radix_cache import RadixCache
from runtime.sampling_params import CLIP_MAX_NEW_TOKENS

if TYPE_CHECKING:
    from runtime.mem.allocator import TokenToKVPoolAllocator
    from runtime.mem.prefix_cache import TreeNode
    from runtime.managers.req import Req
    from runtime.managers.schedule_batch import ScheduleBatch

# Prefix matching every waiting request is O(queue * prompt); past this queue
# length the cache-aware policies fall back to fcfs, as SGLang does.
LPM_MAX_QUEUE = 128
# lpm: a request whose cached prefix is shorter than this, and whose first this-many
# tokens equal an earlier waiting request's, waits behind the others this round:
# once the earlier one is prefilled, it hits the cache instead of recomputing.
IN_BATCH_PREFIX_TOKENS = 32


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: PrefixCache, seed: int | None = None, low_priority_first: bool = False) -> None:
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)
        self.priority_sign = -1 if low_priority_first else 1  # priority: larger (or smaller) values first

    def calc_priority(self, queue: list[Req]) -> bool:
        """Reorder `queue` in place. Returns True if prefixes were matched here."""
        policy = self.policy
        tree = self.tree_cache if isinstance(self.tree_cache, RadixCache) else None  # ChunkCache matches nothing
        if policy in ("lpm", "dfs-weight") and (len(queue) > LPM_MAX_QUEUE or tree is None):
            policy = "fcfs"
        if policy == "fcfs":
            return False
        if policy == "lof":
            queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(queue)
        elif policy == "priority":
            queue.sort(key=lambda r: (-r.priority * self.priority_sign, r.arrival_time))
        elif policy == "lpm":
            for r in queue:
                r.init_next_round_input(self.tree_cache)
            later = self._in_batch_duplicates(queue)
            queue.sort(key=lambda r: (id(r) in later, -len(r.prefix_indices)))
            return True
        elif policy == "dfs-weight" and tree is not None:
            for r in queue:
                r.init_next_round_input(tree)
            self._sort_dfs_weight(queue, tree.root)
            return True
        return False

    @staticmethod
    def _in_batch_duplicates(queue: list[Req]) -> set[int]:
        seen: set[tuple[int, ...]] = set()
        later: set[int] = set()
        for r in queue:
            if len(r.prefix_indices) >= IN_BATCH_PREFIX_TOKENS or len(r.fill_ids) < IN_BATCH_PREFIX_TOKENS:
                continue
            head = tuple(r.fill_ids[:IN_BATCH_PREFIX_TOKENS])
            if head in seen:
                later.add(id(r))
            else:
                seen.add(head)
        return later

    @staticmethod
    def _sort_dfs_weight(queue: list[Req], root: TreeNode) -> None:
        """Visit the tree depth-first, heaviest subtree (most waiting requests) first,
        so requests sharing a prefix run back to back."""
        by_node: dict[int, list[Req]] = {}
        weight: dict[int, int] = {}
        for r in queue:
            node = r.last_node
            by_node.setdefault(id(node), []).append(r)
            while node is not None:
                weight[id(node)] = weight.get(id(node), 0) + 1
                node = node.parent
        order: list[Req] = []

        def visit(node: TreeNode) -> None:
            order.extend(by_node.get(id(node), []))
            for child in sorted(node.children.values(), key=lambda c: -weight.get(id(c), 0)):
                if weight.get(id(child)):
                    visit(child)

        visit(root)
        queue[:] = order


class AddReqResult(enum.Enum):
    CONTINUE = enum.auto()  # more requests may fit
    NO_TOKEN = enum.auto()  # the KV pool cannot take more
    OTHER = enum.auto()  # the prefill token or chunk budget is spent


class PrefillAdder:
    """Admits waiting requests into one prefill batch under three budgets.

    - rem_input_tokens: max_prefill_tokens minus decode tokens mixed in.
    - rem_chunk_tokens: chunked_prefill_size minus decode tokens mixed in (None = no chunking).
    - rem_total_tokens: free + evictable KV, minus what running and admitted
      requests will still need (their future decode tokens scaled by new_token_ratio).
    """

    def __init__(
        self,
        page_size: int,
        tree_cache: PrefixCache,
        allocator: TokenToKVPoolAllocator,
        running_batch: ScheduleBatch,
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        mixed_with_decode_tokens: int = 0,
    ) -> None:
        self.page_size = page_size
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = max_prefill_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = None if chunked_prefill_size is None else chunked_prefill_size - mixed_with_decode_tokens
        # (A finished request not yet out of the running batch holds nothing back.)
        self.rem_total_token_offset = mixed_with_decode_tokens + sum(
            self.reserved(r) for r in running_batch.reqs if not r.finished()
        )
        self.running_bs = running_batch.batch_size()
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.log_input_tokens = 0
        self.log_hit_tokens = 0

    @property
    def rem_total_tokens(self) -> float:
        return self.allocator.available_size() + self.tree_cache.evictable_size() - self.rem_total_token_offset

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def reserved(self, running: Req) -> float:
        """The decode tokens a running request's admission still holds back."""
        return min(running.sampling_params.max_new_tokens - len(running.output_ids), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    def drop_running(self, running: Req) -> None:
        """`running` left the running batch (preempted): what it held back is free again."""
        self.rem_total_token_offset -= self.reserved(running)
        self.running_bs -= 1

    def _need(self, req: Req, alone: bool | None) -> tuple[int, int]:
        """(KV tokens admitting `req` needs, its max_new_tokens as reserved)."""
        max_new = min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        # A request alone in the system only needs room for its prompt: admission
        # checks guarantee prompt + max_new_tokens fits the pool, so it can finish.
        if alone is None:
            alone = self.running_bs == 0 and not self.can_run_list
        return (self._ceil_page(req.extend_input_len) if alone else req.extend_input_len + max_new), max_new

    def budget_allows(self, req: Req) -> bool:
        """Whether the prefill token and chunk budgets leave `req` (or a chunk of it) room:
        add_req refuses it otherwise (OTHER), whatever the KV."""
        input_tokens = self._ceil_page(req.extend_input_len)
        if input_tokens > self.rem_input_tokens and self.can_run_list:
            return False
        chunk = self.rem_chunk_tokens
        return chunk is None or input_tokens <= chunk or chunk // self.page_size * self.page_size > 0

    def deficit(self, req: Req, alone: bool | None = None) -> float:
        """KV tokens add_req lacks to admit `req`: it refuses it (NO_TOKEN) unless < 0.
        `alone`: as if nothing else ran (None: as things are)."""
        self.tree_cache.inc_lock_ref(req.last_node)  # as add_req counts: its prefix is not evictable
        lack = self._need(req, alone)[0] - self.rem_total_tokens
        self.tree_cache.dec_lock_ref(req.last_node)
        return lack

    def _prefill_one_req(self, prefix_len: int, extend_len: int, max_new_tokens: int) -> None:
        self.rem_total_token_offset += extend_len + max_new_tokens
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
        self.log_input_tokens += extend_len
        self.log_hit_tokens += prefix_len

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue the chunked request first; returns it if it needs another round."""
        limit = self.rem_chunk_tokens if self.rem_chunk_tokens is not None else req.extend_input_len
        truncated = req.extend_input_len > limit
        if truncated:
            req.extend_input_len = limit // self.page_size * self.page_size
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + req.extend_input_len]
        self.can_run_list.append(req)
        max_new = 0 if truncated else min(req.sampling_params.max_new_tokens - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
        self._prefill_one_req(len(req.prefix_indices), req.extend_input_len, max_new)
        return req if truncated else None

    def add_req(self, req: Req) -> AddReqResult:
        need, max_new = self._need(req, None)
        input_tokens = self._ceil_page(req.extend_input_len)
        prefix_len = len(req.prefix_indices)

        self.tree_cache.inc_lock_ref(req.last_node)  # its prefix is no longer evictable
        if need >= self.rem_total_tokens:
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddReqResult.NO_TOKEN
        if input_tokens > self.rem_input_tokens and self.can_run_list:
            self.tree_cache.dec_lock_ref(req.last_node)
            return AddReqResult.OTHER

        if self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens:
            self.can_run_list.append(req)
            self._prefill_one_req(prefix_len, req.extend_input_len, max_new)
        else:
            trunc_len = self.rem_chunk_tokens // self.page_size * self.page_size
            if trunc_len <= 0:
                self.tree_cache.dec_lock_ref(req.last_node)
                return AddReqResult.OTHER
            req.extend_input_len = trunc_len
            req.fill_ids = req.fill_ids[: prefix_len + trunc_len]
            self.can_run_list.append(req)
            self.new_chunked_req = req
            self._prefill_one_req(prefix_len, trunc_len, 0)
        return self.budget_state()
