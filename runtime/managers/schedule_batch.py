"""ScheduleBatch: the scheduler's batch.

ScheduleBatch lives on the scheduler side and manipulates the memory pools;
`get_model_worker_batch` snapshots just what the worker needs (a ModelWorkerBatch),
so the scheduler can go on mutating the ScheduleBatch while that forward runs
(overlap).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast
import torch

from runtime.managers.prompt_logprobs import PromptLogprobRows
from runtime.managers.req import Req
from runtime.managers.sampling_batch import sampling_info_of, with_pending_resets
from runtime.mem.allocator import TokenToKVPoolAllocator
from runtime.mem.prefix_cache import PrefixCache
from runtime.mem.req_to_token_pool import ReqToTokenPool
from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.future_map import FutureMap
from runtime.model_executor.sampling_info import SamplingBatchInfo
from runtime.model_executor.worker import ModelWorkerBatch


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: PrefixCache
    forward_mode: ForwardMode = ForwardMode.IDLE
    # Per request, aligned with `reqs`.
    seq_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    input_ids: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    prefix_slots: list[torch.Tensor | None] = field(default_factory=list)
    # Next-token placeholder of each request (a future id < 0), set at launch.
    next_input: list[int] = field(default_factory=list)
    decoding_reqs: list[Req] = field(default_factory=list)  # decodes riding in a MIXED batch
    # The request whose chunk in this batch does not end its prompt: it samples nothing
    # real. (Its is_chunked count lags under overlap: the previous chunk's result may
    # not be processed when this batch is built.)
    intermediate_chunk: Req | None = None
    batch_is_full: bool = False
    epochs: list[int] = field(default_factory=list)
    prompt_lp: PromptLogprobRows | None = None  # the prompt positions this prefill scores
    # Decode rounds over the same requests share one SamplingBatchInfo (immutable
    # once built); any change to `reqs` drops it.
    _decode_sampling: SamplingBatchInfo | None = None

    def _rows(self) -> list[int]:
        # Hot path (every decode round): the raw field, not Req.row's checked property.
        # Every request of a batch that reaches a forward holds a row.
        return cast(list[int], [r.req_pool_idx for r in self.reqs])

    def is_empty(self) -> bool:
        return not self.reqs

    def batch_size(self) -> int:
        return len(self.reqs)

    # ---- memory -------------------------------------------------------------
    def _evict_for(self, num_tokens: int) -> None:
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)

    def _alloc_extend(self, prefix_lens: list[int], extend_lens: list[int], rows: list[int]) -> torch.Tensor:
        table = self.req_to_token_pool.req_to_token
        last_locs = []
        if self.allocator.page_size > 1:
            last_locs = [int(table[r, p - 1]) if p > 0 else 0 for r, p in zip(rows, prefix_lens)]
        self._evict_for(sum(extend_lens) + len(extend_lens) * self.allocator.page_size)
        out = self.allocator.alloc_extend(prefix_lens, extend_lens, last_locs)
        if out is None:
            raise RuntimeError("KV pool exhausted during prefill; PrefillAdder budgets were violated")
        return out

    # ---- building forwards ---------------------------------------------------
    def prepare_for_extend(self) -> None:
        """Allocate rows and KV slots for each request's `fill_ids[prefix:]`."""
        self.forward_mode = ForwardMode.EXTEND
        pool = self.req_to_token_pool
        for req in self.reqs:
            if req.req_pool_idx is None:
                row = pool.alloc()
                if row is None:
                    raise RuntimeError("request pool exhausted; PrefillAdder admitted too many requests")
                req.req_pool_idx = row
        rows = [r.row for r in self.reqs]
        self.prefix_lens = [len(r.prefix_indices) for r in self.reqs]
        self.extend_lens = [r.extend_input_len for r in self.reqs]
        self.seq_lens = [p + n for p, n in zip(self.prefix_lens, self.extend_lens)]
        self.prompt_lp = PromptLogprobRows.plan(self.reqs, self.prefix_lens, self.extend_lens)
        for req, row, p in zip(self.reqs, rows, self.prefix_lens):
            if p:
                pool.write(row, 0, req.prefix_indices)
        out_cache_loc = self.out_cache_loc = self._alloc_extend(self.prefix_lens, self.extend_lens, rows)
        start = 0
        ids: list[int] = []
        for req, row, p, n in zip(self.reqs, rows, self.prefix_lens, self.extend_lens):
            pool.write(row, p, out_cache_loc[start : start + n])
            ids.extend(req.fill_ids[p : p + n])
            start += n
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
        self.input_ids = torch.tensor(ids, dtype=torch.int64)
        self.prefix_slots = [r.prefix_indices for r in self.reqs]

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append running decodes as extend-length-1 requests (ForwardMode.MIXED)."""
        running.prepare_for_decode()
        self.forward_mode = ForwardMode.MIXED
        self.decoding_reqs = list(running.reqs)
        self.reqs = self.reqs + running.reqs
        self.prefix_lens = self.prefix_lens + [s - 1 for s in running.seq_lens]
        self.extend_lens = self.extend_lens + [1] * running.batch_size()
        self.seq_lens = self.seq_lens + running.seq_lens
        assert self.input_ids is not None and running.input_ids is not None
        assert self.out_cache_loc is not None and running.out_cache_loc is not None
        self.input_ids = torch.cat([self.input_ids, running.input_ids])
        self.out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])
        self.prefix_slots = self.prefix_slots + [None] * running.batch_size()

    def decode_tokens_needed(self) -> int:
        """KV slots the next decode step takes: a fresh page where the next token
        starts one (the token at position seq_len)."""
        p = self.allocator.page_size
        if p == 1:
            return len(self.seq_lens)
        return sum(p for s in self.seq_lens if s % p == 0)

    def check_decode_mem(self) -> bool:
        need = self.decode_tokens_needed()
        if self.allocator.available_size() >= need:
            return True
        self._evict_for(need)
        return self.allocator.available_size() >= need

    def prepare_for_decode(self) -> None:
        """One new token per request; its input is the request's future placeholder."""
        self.forward_mode = ForwardMode.DECODE
        self.prompt_lp = None
        pool = self.req_to_token_pool
        rows = self._rows()
        self._evict_for(self.decode_tokens_needed())
        self.seq_lens = [s + 1 for s in self.seq_lens]
        self.prefix_lens = positions = [s - 1 for s in self.seq_lens]  # of the new tokens
        self.extend_lens = [1] * len(self.reqs)
        last_locs = pool.slots_at(rows, [p - 1 for p in positions]) if self.allocator.page_size > 1 else []
        out = self.allocator.alloc_decode(self.seq_lens, last_locs)
        if out is None:
            raise RuntimeError("KV pool exhausted during decode; check_decode_mem should have retracted")
        self.out_cache_loc = out
        pool.write_tokens(rows, positions, out)
        self.input_ids = torch.tensor(self.next_input, dtype=torch.int64)
        self.prefix_slots = [None] * len(self.reqs)

    def retract_decode(self, rank: Callable[[Req], int] | None = None) -> list[Req]:
        """Remove requests (lowest `rank` if given, then fewest outputs, then longest
        prompts, first) until the rest can decode."""
        order = sorted(
            range(self.batch_size()),
            key=lambda i: (rank(self.reqs[i]) if rank else 0, len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)),
            reverse=True,
        )
        retracted: list[Req] = []
        while not self.check_decode_mem():
            if len(order) == 1:
                raise RuntimeError("KV pool too small for a single request; admission should have rejected it")
            i = order.pop()
            retracted.append(self.retract(i))
            order = [j - (j > i) for j in order]
        self.batch_is_full = False
        return retracted

    def retract(self, i: int) -> Req:
        """Send request i back to waiting. It keeps its output; its computed KV goes to the
        prefix cache, so re-prefilling it mostly hits the cache; the result of a forward
        launched before is dropped (its epoch moves)."""
        req = self.reqs[i]
        self.tree_cache.cache_finished_req(req, kv_len=self.seq_lens[i])
        req.reset_for_retract()
        self.filter_batch([j for j in range(self.batch_size()) if j != i])
        return req

    # ---- set operations ----------------------------------------------------------
    def filter_batch(self, keep: list[int]) -> None:
        if len(keep) != len(self.reqs):  # keep is an ascending subset of range(len(reqs))
            self._decode_sampling = None
            self.batch_is_full = False  # a row or KV was freed: admission must look again
        self.reqs = [self.reqs[i] for i in keep]
        self.seq_lens = [self.seq_lens[i] for i in keep]
        self.next_input = [self.next_input[i] for i in keep]

    def drop_reqs_ending_in_flight(self) -> None:
        """Remove requests that the in-flight forward brings to max_new_tokens."""
        keep = [i for i, r in enumerate(self.reqs) if len(r.output_ids) + 1 < r.sampling_params.max_new_tokens]
        if len(keep) < len(self.reqs):
            self.filter_batch(keep)

    def merge_batch(self, other: ScheduleBatch) -> None:
        self._decode_sampling = None
        self.reqs = self.reqs + other.reqs
        self.seq_lens = self.seq_lens + other.seq_lens
        self.next_input = self.next_input + other.next_input

    def get_model_worker_batch(self, futures: FutureMap) -> ModelWorkerBatch:
        bs = len(self.reqs)
        self.next_input = futures.alloc(bs)
        future_ids = torch.tensor(self.next_input, dtype=torch.int64)
        self.epochs = [r.epoch for r in self.reqs]
        tops = [(r.top_logprobs_num if r.return_logprob else -1) for r in self.reqs]
        row_syncs = []
        for r, p, slots in zip(self.reqs, self.prefix_lens, self.prefix_slots):
            if r.row_dirty:
                r.row_dirty = False
                if slots is None:  # an extend rewrites its whole prefix anyway
                    row_syncs.append((r.row, self.req_to_token_pool.req_to_token[r.row, :p].clone()))
        assert self.input_ids is not None and self.out_cache_loc is not None
        sampling = self._sampling_info()
        if any(r.penalty_reset_pending for r in self.reqs):  # one step only: not in the cached info
            sampling = with_pending_resets(self.reqs, sampling)
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=self._rows(),
            seq_lens=list(self.seq_lens),
            extend_prefix_lens=list(self.prefix_lens),
            extend_seq_lens=list(self.extend_lens),
            prefix_slots=list(self.prefix_slots),
            row_syncs=row_syncs,
            sampling=sampling,
            future_ids=future_ids,
            top_logprobs_nums=tops,
            return_logprob=any(t >= 0 for t in tops),
            prompt_logprob_rows=lp.rows if (lp := self.prompt_lp) is not None else [],
            role_switches=[r.role_switches for r in self.reqs],
            prompt_logprob_targets=lp.targets if lp is not None else [],
            prompt_top_k=lp.top_k if lp is not None else 0,
        )

    def _sampling_info(self) -> SamplingBatchInfo:
        if not self.forward_mode.is_decode():
            return sampling_info_of(self.reqs, self.forward_mode, self.prefix_slots, self.intermediate_chunk)
        if self._decode_sampling is None:
            self._decode_sampling = sampling_info_of(self.reqs, self.forward_mode, self.prefix_slots)
        return self._decode_sampling

    def copy_for_result(self) -> ScheduleBatch:
        """A shallow snapshot for process_batch_result while `self` keeps changing."""
        return ScheduleBatch(
            reqs=list(self.reqs),
            req_to_token_pool=self.req_to_token_pool,
            allocator=self.allocator,
            tree_cache=self.tree_cache,
            forward_mode=self.forward_mode,
            seq_lens=list(self.seq_lens),
            prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens),
            out_cache_loc=self.out_cache_loc,
            decoding_reqs=list(self.decoding_reqs),
            epochs=list(self.epochs),
            prompt_lp=self.prompt_lp,
        )
