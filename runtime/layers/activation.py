"""The gated MLP of Llama-family models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import Linear, MergedLinear


class SiluAndMulMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size))
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
