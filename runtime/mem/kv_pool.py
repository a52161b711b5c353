"""The per-layer KV pool: K and V tensors indexed by KV slot."""

from __future__ import annotations

import math

import numpy as np
import torch


def _untouched_zeros(shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the OS fills on first touch (numpy's zeros is calloc)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVPool:
    """`k_buffer[layer][slot]` is one token's keys, `[num_kv_heads, head_dim]`.

    Slot 0 is never handed out by the allocator: padded positions (CUDA-graph
    padding, idle rows) write there harmlessly.
    """

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (size + 1, num_kv_heads, head_dim)
        # Zeros (padding reads slot 0 and a page's unwritten tail; garbage there would
        # be NaN * 0 = NaN). On CPU they come from calloc, which maps fresh zero pages
        # without touching them: torch.zeros memsets, which took 8.5 s of a 12 s start
        # for the default 4 GiB pool.
        if torch.device(device).type == "cpu":
            self.k_buffer = [_untouched_zeros(shape, dtype) for _ in range(num_layers)]
            self.v_buffer = [_untouched_zeros(shape, dtype) for _ in range(num_layers)]
        else:
            self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]
