"""A GGUF tensor as a checkpoint weight, and its Q4_0/Q4_1/Q8_0 blocks as int4 planes.

llama.cpp's blocks cover 32 consecutive input columns of one row (its `QK4_0 = QK4_1 =
QK8_0 = 32`), which is exactly a group of torch's int4 kernel at group size 32, whose
weight is `(q - 8) * scale + zero` per group with `q` in [0, 15]:

    Q4_0  w = d * (q - 8)           -> scale = d, zero = 0
    Q4_1  w = d * q + m             -> scale = d, zero = m + 8 * d
    Q8_0  w = d * q8, q8 in int8    -> two planes: with u = q8 + 128 = 16 * hi + lo,
          w = (hi - 8) * 16d + 0  +  (lo - 8) * d + 8d

so one plane (Q4) or the sum of two (Q8_0) reproduces the GGUF weight exactly; the
only loss is rounding `scale` and `zero` (fp16/fp32 here) to the kernel's bfloat16.
A box is decoded block by block: nothing float of the box's size is ever built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from runtime.layers.weights import LazyWeight

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

BLOCK = 32  # input columns per block: every type of PLANES
PLANES = {"Q4_0": 1, "Q4_1": 1, "Q8_0": 2}  # int4 planes a block decodes to
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # fp16 d [, fp16 m], then the codes


class Int4Planes(NamedTuple):
    """`P` int4 planes whose sum is the weight: plane p of row n, group g is
    `(q[p, n, cols of g] - 8) * scale[p, n, g] + zero[p, n, g]`."""

    q: torch.Tensor  # uint8 [P, n, k] in [0, 15]
    scale: torch.Tensor  # float32 [P, n, k / BLOCK]
    zero: torch.Tensor  # float32 [P, n, k / BLOCK]

    def dequantize(self) -> torch.Tensor:
        """float32 `[n, k]`, summed in float64 so each plane's exact value is rounded once.
        One plane whose scales are fp16 values (a GGUF's Q4 blocks) is computed in float32,
        3x faster and the same bits: (q - 8) * scale, 4 bits times 11, is exact there, and
        the one add rounds once."""
        p, n, k = self.q.shape
        if p == 1 and torch.equal(self.scale.half().float(), self.scale):
            groups = self.q[0].float().view(n, k // BLOCK, BLOCK) - 8
            return (groups * self.scale[0][..., None] + self.zero[0][..., None]).view(n, k)
        groups = self.q.double().view(p, n, k // BLOCK, BLOCK) - 8
        w = groups * self.scale.double()[..., None] + self.zero.double()[..., None]
        return w.sum(0).view(n, k).float()


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of a GGUF file, memory-mapped: `data` is the reader's array, one row per
    output row in the file's order (bytes for a block type, floats for F32/F16), and
    logical row `i` is stored row `row_order[i]` (None = the identity)."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # (rows, columns), torch's order
    data: np.ndarray
    row_order: np.ndarray | None = None

    @property
    def planes(self) -> int:
        """int4 planes per block, 0 for a type that is not packed (read as float)."""
        return PLANES.get(self.qtype.name, 0)

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.data[start:stop] if self.row_order is None else self.data[self.row_order[start:stop]]


@dataclass(frozen=True, slots=True)
class GgufWeight(LazyWeight):
    """A `LazyWeight` over a GGUF tensor. `materialize` is gguf's own float32 dequantization
    (the float fallback, and the reference); `int4_planes` is the packed path."""

    tensor: GgufTensor

    @classmethod
    def of_tensor(cls, tensor: GgufTensor) -> GgufWeight:
        return cls(lambda box: dequantize_box(tensor, box), tensor.shape, tuple((0, n) for n in tensor.shape), tensor)

    @property
    def packable(self) -> bool:
        """A block type whose box starts and ends on block boundaries."""
        (_, _), (k0, k1) = self.box
        return self.tensor.planes > 0 and k0 % BLOCK == 0 and k1 % BLOCK == 0

    def int4_planes(self) -> Int4Planes:
        if not self.packable:
            raise ValueError(f"{self.tensor.name}: {self.tensor.qtype.name} box {self.box} has no int4 planes")
        (r0, r1), (k0, k1) = self.box
        kind, nbytes = self.tensor.qtype.name, BLOCK_BYTES[self.tensor.qtype.name]
        raw = self.tensor.rows(r0, r1)[:, k0 // BLOCK * nbytes : k1 // BLOCK * nbytes]
        return _decode(kind, raw.reshape(r1 - r0, (k1 - k0) // BLOCK, nbytes))


# Decoding runs in numpy: its strided uint8 ops are many times faster than torch's here.


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block, as float32 `[n, blocks]`."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4 byte j holds element j (low nibble) and element j + 16 (high)."""
    return np.concatenate([codes & 0x0F, codes >> 4], axis=-1)


def _decode(kind: str, blocks: np.ndarray) -> Int4Planes:
    """`blocks` uint8 `[n, blocks, bytes]` of one type -> its int4 planes."""
    n, nb, _ = blocks.shape
    d = _f16(blocks, 0)
    if kind == "Q4_0":
        q, scale, zero = _nibbles(blocks[..., 2:18])[None], d[None], np.zeros_like(d)[None]
    elif kind == "Q4_1":
        q, scale, zero = _nibbles(blocks[..., 4:20])[None], d[None], (_f16(blocks, 2) + 8 * d)[None]
    else:  # Q8_0
        u = blocks[..., 2:34].copy().view(np.int8).astype(np.int16) + 128  # [0, 255]
        q = np.stack([u >> 4, u & 0x0F]).astype(np.uint8)
        scale, zero = np.stack([16 * d, d]), np.stack([np.zeros_like(d), 8 * d])
    return Int4Planes(torch.from_numpy(q.reshape(-1, n, nb * BLOCK)), torch.from_numpy(scale), torch.from_numpy(zero))


def dequantize_box(tensor: GgufTensor, box: tuple[slice, ...]) -> torch.Tensor:
    """float32 values of `box` through gguf's own dequantization (whole blocks are read;
    a box cut inside a block is trimmed after)."""
    from gguf import GGML_QUANT_SIZES, dequantize

    rows, cols = box
    block, nbytes = GGML_QUANT_SIZES[tensor.qtype]
    first, last = cols.start // block, -(-cols.stop // block)
    raw = tensor.rows(rows.start, rows.stop)
    # The reader gives F32/F16 rows as floats, every other type's rows as bytes.
    raw = raw[:, first * nbytes : last * nbytes] if raw.dtype == np.uint8 else raw[:, first:last]
    values = dequantize(np.ascontiguousarray(raw), tensor.qtype).reshape(raw.shape[0], -1)
    start = cols.start - first * block
    return torch.from_numpy(np.ascontiguousarray(values[:, start : start + cols.stop - cols.start]))
