"""The gated MLP of Llama-family models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class SiluAndMulMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one matmul.

    Each rank holds its slice of the intermediate (gate and up rows alike), so the
    activation is local and down_proj's all-reduce is the MLP's only collective."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, (intermediate_size, intermediate_size))
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
