"""The interface every attention backend implements."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from runtime.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Plan once per batch; `forward` reuses the plan for every layer."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the batch's new tokens.

        Writes k, v into the KV pool at `fb.out_cache_loc`, then attends each new
        token to its request's prefix and to the new tokens at or before it.
        Returns [T, Hq, D].
        """
        ...
