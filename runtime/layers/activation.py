"""The gated MLP of Llama-family models."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from kernels.cpu import CpuOps


class SiluAndMulMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one matmul.

    Each rank holds its slice of the intermediate (gate and up rows alike), so the
    activation is local and down_proj's all-reduce is the MLP's only collective."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, (intermediate_size, intermediate_size))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.ops: CpuOps | None = None  # set by runtime.models.cpu_path.bind_cpu_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:  # one pass over [T, 2 * intermediate], no chunk views
            return self.down_proj(self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
