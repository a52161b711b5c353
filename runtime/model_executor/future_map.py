"""Future token ids: placeholders for tokens a forward has not produced yet.

The scheduler builds batch N+1 while batch N runs, so N+1's decode inputs are
negative ids `-k`. The worker stores N's sampled tokens at `buf[k]` and resolves
N+1's placeholders on the device; forwards run in order, so N is always done.
"""

from __future__ import annotations

import torch


class FutureMap:
    def __init__(self, capacity: int, device: torch.device | str) -> None:
        # A placeholder lives for about one round; capacity only has to exceed the
        # tokens two consecutive batches produce, so ring reuse is safe.
        self.capacity = capacity
        self.buf = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        self._next = 0  # scheduler-side counter

    def alloc(self, n: int) -> list[int]:
        """Scheduler side: n fresh placeholders (negative ids), as plain ints."""
        start, cap = self._next, self.capacity
        self._next = (start + n) % cap
        return [-((start + i) % cap + 1) for i in range(n)]

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Worker side: replace placeholders by the tokens stored under them."""
        return torch.where(input_ids < 0, self.buf[(-input_ids).clamp(min=0)], input_ids)

    def store(self, future_ids: torch.Tensor, tokens: torch.Tensor) -> None:
        self.buf[-future_ids.to(self.buf.device)] = tokens
