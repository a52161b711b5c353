"""ReqToTokenPool: one row per running request, mapping token position -> KV slot."""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """A running request owns `req_to_token[row, :seq_len]`.

    This is the scheduler's (host) copy. The worker keeps its own device copy and
    applies each batch's writes in forward order, so the scheduler may reuse a row
    while an earlier forward that still reads it is in flight.
    """

    def __init__(self, size: int, context_len: int) -> None:
        self.size = size
        self.context_len = context_len
        self.req_to_token = torch.zeros((size, context_len), dtype=torch.int32)
        # The same memory as numpy: a decode round's few scalar reads and writes cost
        # ~1 us there, against a torch dispatch (which releases the GIL) per op.
        self._table = self.req_to_token.numpy()
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, row: int) -> None:
        assert row not in self.free_slots, f"double free of request row {row}"
        self.free_slots.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)

    def write_tokens(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """req_to_token[rows[i], positions[i]] = slots[i] (one token per request)."""
        self._table[rows, positions] = slots.numpy()

    def slots_at(self, rows: list[int], positions: list[int]) -> list[int]:
        return self._table[rows, positions].tolist()

    def clear(self) -> None:
        self.free_slots = list(range(self.size))
