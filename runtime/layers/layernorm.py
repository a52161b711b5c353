"""RMSNorm with the residual add fused in."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from kernels.cpu import CpuOps


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalize in float32, cast back, then scale by `weight`.

    `forward(x, residual)` fuses the residual add: it returns `(norm(x + residual),
    x + residual)`, the residual stream staying in the model dtype as in HF. With the
    CPU kernels bound (`ops`), both are one pass over `[T, hidden]` and the sum is
    written into `residual` in place: the caller's old residual is dead after the call.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.ops: CpuOps | None = None  # set by runtime.models.cpu_path.bind_cpu_ops

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        if ops is not None and x.dim() == 2:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.add_rms_norm_(x, residual, self.weight, self.eps), residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
