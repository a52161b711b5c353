"""Batch-invariant matmuls (`--enable-deterministic-inference`).

A GEMM library picks its kernel, blocking and K-split from the problem shape: on
this project's CPUs a float32 row computed alone (M = 1, a GEMV) differs in the last
bits from the same row in a batch, and bfloat16 rows change once M passes 32. A
temperature-0 request then decodes differently depending on what runs beside it.

The fix is to never let M vary: every float matmul runs as calls of exactly
`BLOCK_ROWS` rows, the last block padded with zeros. One shape means one kernel and
one reduction order for every row, at any batch size; within a call rows do not
interact and a row's result does not depend on its position in the block (checked
for both dtypes by tests/test_deterministic_kernels.py). Zero padding costs compute
at M < 16 (a decode step of a few requests), nothing in memory-bound GEMVs.

Layers whose kernel is already per-row (torch's int4 and int8 weight-only kernels:
each output is one sequential K loop per row, whatever M) declare `row_invariant`
and skip the blocking.

A GGUF's Q4 layers have two per-row kernels: the exact Q4 blocks (fast at a few rows)
and a dense copy on the kernels' own GEMM (fast for a prefill): bfloat16 tiles (AMX /
AVX512-BF16) or float32 panels (AVX2). Outside this mode the row count picks one. In it,
a row's role does (runtime/token_roles.py): `PromptRows` marks a
forward's given tokens, which take the copy, and every answer token (a decode, a
retracted request's recomputed output, an earlier answer a chat sends back) takes the
Q4 blocks. A token's kernel is then fixed by its request, so prefills run as fast as by
default and decodes as well.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.token_roles import segments

BLOCK_ROWS = 16


def in_fixed_row_blocks(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`matmul(x)` computed as calls on exactly BLOCK_ROWS rows of `x` (`[..., K]`)."""
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    pad = -m % BLOCK_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([matmul(rows[i : i + BLOCK_ROWS]) for i in range(0, m + pad, BLOCK_ROWS)])
    return out[:m].view(*x.shape[:-1], out.shape[-1])


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose every row is independent of the other rows."""
    return in_fixed_row_blocks(lambda rows: F.linear(rows, weight, bias), x)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """The rows of one forward's packed tokens that are given text, not answers
    (deterministic inference: they take a layer's dense copy, int4.has_invariant_copy;
    the rest take its Q4 blocks). `order is None`: every row is given text. A split forward computes its rows
    gathered in `order` and puts them back with `restore`, one gather each way (cheaper
    than scattering two outputs)."""

    order: torch.Tensor | None  # [T] int64: the given-text rows, then the answers'
    restore: torch.Tensor | None  # [T]: row i of the output is row restore[i] of the gathered one
    given: int = 0  # how many of `order` are given text

    @property
    def dense(self) -> torch.Tensor | None:  # the given-text rows
        return None if self.order is None else self.order[: self.given]

    @property
    def rest(self) -> torch.Tensor | None:  # the answers' rows
        return None if self.order is None else self.order[self.given :]

    @staticmethod
    def of(prefix_lens: Sequence[int], extend_lens: Sequence[int], switches: Sequence[Sequence[int]]) -> PromptRows | None:
        """Request i extends positions [prefix, prefix + extend), whose roles its
        `switches` give (runtime/token_roles.py). None: no row is given text."""
        dense: list[int] = []
        rest: list[int] = []
        start = 0
        for p, n, cuts in zip(prefix_lens, extend_lens, switches):
            for lo, hi, answer in segments(cuts, p, p + n):
                (rest if answer else dense).extend(range(start + lo - p, start + hi - p))
            start += n
        if not dense:
            return None
        if not rest:
            return PromptRows(None, None)
        order = torch.tensor(dense + rest)
        return PromptRows(order, torch.argsort(order), len(dense))

    def select(self, rows: torch.Tensor) -> PromptRows | None:
        """These roles for a forward of just rows `rows` (packed indices) of this one."""
        if self.order is None:  # every row is given text
            return self
        given = torch.zeros(self.order.numel(), dtype=torch.bool, device=self.order.device)
        given[self.order[: self.given]] = True
        kept = given[rows.to(given.device)]
        dense, rest = torch.nonzero(kept).flatten(), torch.nonzero(~kept).flatten()
        if not dense.numel():
            return None
        if not rest.numel():
            return PromptRows(None, None)
        order = torch.cat([dense, rest])
        return PromptRows(order, torch.argsort(order), int(dense.numel()))


_PROMPT_ROWS: ContextVar[PromptRows | None] = ContextVar("sluice_prompt_rows", default=None)


@contextmanager
def forward_prompt_rows(rows: PromptRows | None) -> Iterator[None]:
    """`rows` is what `prompt_rows()` answers inside the block (one forward)."""
    token = _PROMPT_ROWS.set(rows)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def prompt_rows() -> PromptRows | None:
    """The current forward's prompt rows (deterministic inference), or None: none."""
    return _PROMPT_ROWS.get()


def select_prompt_rows(rows: torch.Tensor) -> PromptRows | None:
    """The current forward's prompt rows as those of a forward of rows `rows` only."""
    current = _PROMPT_ROWS.get()
    return None if current is None else current.select(rows)
