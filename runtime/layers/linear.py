"""Linear layers over the packed token layout `[T, in]`.

Parameters are created with `torch.empty` (no init pass): models are built directly
on the target device in the target dtype, then filled by `load_weights` or by the
dummy initializer. Every linear layer of a model lives here, so tensor-parallel
splits and quantized weights have one home.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x @ weight.T + bias` with `weight: [out, in]` (the HF checkpoint layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several checkpoint projections of the same input stacked along the output dim.

    Output rows `[offsets[i], offsets[i] + sizes[i])` hold shard i (q|k|v or
    gate|up), so one matmul replaces several; `load_shard` fills one shard.
    """

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = shard_sizes
        self.shard_offsets = tuple(sum(shard_sizes[:i]) for i in range(len(shard_sizes)))

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        param = self.weight if param_name == "weight" else self.bias
        assert param is not None, f"checkpoint has a {param_name} this layer was built without"
        dst = param.data.narrow(0, self.shard_offsets[shard], self.shard_sizes[shard])
        if dst.shape != tensor.shape:
            raise ValueError(f"shard {shard} of {param_name}: checkpoint {tuple(tensor.shape)} != {tuple(dst.shape)}")
        dst.copy_(tensor)
