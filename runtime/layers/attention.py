"""RadixAttention: a model's attention call, delegated to the batch's backend.

The layer owns only what is per-layer (its id, which selects the KV pool layer,
and the softmax scale); the backend owns the plan shared by every layer.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention.base import AttentionBatch


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, scaling: float) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.scaling = scaling

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: AttentionBatch) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D] (K and V are written to the pool)."""
        return fb.attn_backend.forward(q, k, v, self.layer_id, self.scaling, fb)
