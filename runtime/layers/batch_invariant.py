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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

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
