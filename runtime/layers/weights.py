"""What a checkpoint tensor is to a layer before it is read, and how a parameter loads it.

A `LazyWeight` is a checkpoint tensor not read yet: its full shape, a box (one
`[start, stop)` range per dim) and a `read` function that returns exactly the
elements of a box. `narrow` shrinks the box without reading; `materialize` reads the
box only. safetensors slices and seeded dummy values are both `read` functions, so
every layer has one loading path whatever the weights' source.

Every parameter carries, as vLLM's do, a `weight_loader(param, loaded_weight,
shard_id)` that narrows the full checkpoint tensor to this rank's part and copies it
in, and `checkpoint_shapes`: the full shape of each checkpoint tensor it is filled
from (one per stacked shard), which is what the dummy loader generates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import nn

Shape = tuple[int, ...]
# Which checkpoint tensor of a stacked parameter: "q"/"k"/"v" of qkv_proj, 0/1 (gate/up)
# of gate_up_proj; None for a parameter filled from one checkpoint tensor.
ShardId = int | str | None
ReadFn = Callable[[tuple[slice, ...]], torch.Tensor]
WeightLoader = Callable[[nn.Parameter, "LazyWeight", ShardId], None]


@dataclass(frozen=True, slots=True)
class LazyWeight:
    read: ReadFn  # a box of the full tensor (one step-1 slice per dim) -> those elements only
    full_shape: Shape
    box: tuple[tuple[int, int], ...]  # [start, stop) per dim, within full_shape

    @classmethod
    def of(cls, read: ReadFn, full_shape: Shape) -> LazyWeight:
        return cls(read, tuple(full_shape), tuple((0, n) for n in full_shape))

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> LazyWeight:
        """An in-memory tensor (already read) behind the same interface."""
        return cls.of(tensor.__getitem__, tuple(tensor.shape))

    @property
    def shape(self) -> Shape:
        return tuple(stop - start for start, stop in self.box)

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        dim %= len(self.box)
        lo, hi = self.box[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise IndexError(f"narrow({dim}, {start}, {length}) is outside a weight of shape {self.shape}")
        box = (*self.box[:dim], (lo + start, lo + start + length), *self.box[dim + 1 :])
        return replace(self, box=box)

    def materialize(self) -> torch.Tensor:
        return self.read(tuple(slice(start, stop) for start, stop in self.box))


def copy_into(dst: torch.Tensor, src: LazyWeight) -> None:
    """Read `src` and copy it into `dst`, casting to dst's dtype and device."""
    if tuple(dst.shape) != src.shape:
        raise ValueError(f"checkpoint slice {src.shape} != parameter {tuple(dst.shape)}")
    dst.copy_(src.materialize())


def default_weight_loader(param: nn.Parameter, loaded_weight: LazyWeight, shard_id: ShardId = None) -> None:
    """A replicated parameter (norms): every rank holds the whole checkpoint tensor."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter has no shard {shard_id!r}")
    copy_into(param.data, loaded_weight)


def set_weight_attrs(param: nn.Parameter, weight_loader: WeightLoader, checkpoint_shapes: dict[ShardId, Shape]) -> None:
    setattr(param, "weight_loader", weight_loader)
    setattr(param, "checkpoint_shapes", checkpoint_shapes)


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    return cast(WeightLoader, getattr(param, "weight_loader", default_weight_loader))


def checkpoint_shapes_of(param: nn.Parameter) -> dict[ShardId, Shape]:
    """Full checkpoint shape per shard; a parameter without loader attributes is replicated."""
    shapes = getattr(param, "checkpoint_shapes", None)
    return cast(dict[ShardId, Shape], shapes) if shapes is not None else {None: tuple(param.shape)}
