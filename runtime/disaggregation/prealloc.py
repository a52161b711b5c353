"""DecodePreallocQueue: decode requests waiting for a row and KV slots for their prompt.

Admission leaves every request already admitted (running, or reserved and waiting
for its KV) the share of its remaining tokens that the scheduler's own admission
reserves (`new_token_ratio`), so a reservation never takes decode headroom away.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from runtime.managers.req import Req

if TYPE_CHECKING:
    from runtime.managers.scheduler import Scheduler


def remaining(req: Req) -> int:
    return max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)


class DecodePreallocQueue:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.reqs: list[Req] = []

    def __len__(self) -> int:
        return len(self.reqs)

    def __contains__(self, req: Req) -> bool:
        return req in self.reqs

    def append(self, req: Req) -> None:
        self.reqs.append(req)

    def remove(self, req: Req) -> None:
        self.reqs.remove(req)

    def reserve(self, admitted: list[Req]) -> Iterator[tuple[Req, int, torch.Tensor]]:
        """Reserve a row and prompt slots for the queue's front, FIFO, while they fit:
        each (request, row, slots) leaves the queue with req_to_token[row, :n] = slots."""
        s = self.scheduler
        pools, ratio, page = s.pools, s.decode.new_token_ratio, s.page_size
        reserve = sum(remaining(r) for r in admitted) * ratio
        count = len(admitted)
        while self.reqs and count < s.max_running_requests and pools.req_to_token_pool.available_size():
            req = self.reqs[0]
            n = len(req.origin_input_ids)
            need = -(-n // page) * page + (remaining(req) * ratio + reserve if count else 0)
            if pools.allocator.available_size() < need:
                pools.tree_cache.evict(int(need) - pools.allocator.available_size())
                if pools.allocator.available_size() < need:
                    return
            slots = pools.allocator.alloc(n)
            row = pools.req_to_token_pool.alloc()
            assert slots is not None and row is not None
            pools.req_to_token_pool.write(row, 0, slots)
            req.req_pool_idx = row
            self.reqs.pop(0)
            count += 1
            reserve += remaining(req) * ratio
            yield req, row, slots
