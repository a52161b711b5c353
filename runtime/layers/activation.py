"""The gated MLP of Llama-family models."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from runtime.layers.quantization.q4q8 import Q4Q8LinearMethod

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
        if self.ops is not None:
            method = self.gate_up_proj.quant_method
            # Prefill on AMX: the activation straight from gate|up's tiles (q4q8.silu_mul_dense).
            act = method.silu_mul_dense(self.gate_up_proj, x) if isinstance(method, Q4Q8LinearMethod) else None
            if act is None:  # one pass over [T, 2 * intermediate], no chunk views
                act = self.ops.silu_mul(self.gate_up_proj(x))
            return self.down_proj(act)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
