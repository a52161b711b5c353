"""Where checkpoint tensors come from: safetensors files, or seeded dummy values.

Both yield `(HF name, LazyWeight)` with the full checkpoint shape; each parameter's
weight_loader narrows to its rank's part before anything is read, so a rank reads
(or generates) only its own slices and no rank ever holds the whole model.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from runtime.layers.layernorm import RMSNorm
from runtime.layers.weights import LazyWeight, Shape
from runtime.models.llama import LlamaForCausalLM

DUMMY_STD = 0.02
DUMMY_BLOCK_ELEMENTS = 1 << 22  # dummy values are drawn in row blocks of about this many elements


class ModelNotFoundError(FileNotFoundError):
    """The model path (or the embedded default model) is not there."""


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, LazyWeight]]:
    """Checkpoint tensors over safetensors slices (memory-mapped, on CPU): materializing
    one reads only its box. A weight is readable until the iterator leaves its file."""
    from safetensors import safe_open

    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                yield name, LazyWeight.of(tensor_slice.__getitem__, tuple(tensor_slice.get_shape()))


def dummy_weights(model: LlamaForCausalLM, seed: int | None) -> Iterator[tuple[str, LazyWeight]]:
    """Seeded stand-ins for every checkpoint tensor `model` loads: RMSNorm weights 1,
    the rest Normal(0, DUMMY_STD), drawn on the parameter's device. Values depend only
    on (seed, tensor name, full shape), so tp_size N's shards are slices of tp_size 1's
    weights."""
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, shape, param in model.checkpoint_tensors():
        if id(param) in norms:
            yield name, dummy_ones(shape, param.device)
        else:
            yield name, dummy_normal(name, shape, seed or 0, param.device)


def dummy_ones(shape: Shape, device: torch.device) -> LazyWeight:
    return LazyWeight.of(lambda box: torch.ones(_box_shape(box), device=device), shape)


def dummy_normal(name: str, shape: Shape, seed: int, device: torch.device) -> LazyWeight:
    """Normal(0, DUMMY_STD) values of a `shape` tensor, reading any box without drawing
    the whole tensor at once.

    Rows are grouped in fixed blocks (a function of `shape` only); block b is drawn
    from its own generator seeded by (seed, name, b). A box draws the blocks its rows
    touch, one at a time, and keeps only its part of each."""
    assert shape, "dummy weights are at least 1-D"
    row_elements = math.prod(shape[1:])
    block_rows = max(1, DUMMY_BLOCK_ELEMENTS // max(1, row_elements))

    def read(box: tuple[slice, ...]) -> torch.Tensor:
        out = torch.empty(_box_shape(box), device=device)
        first, stop = int(box[0].start), int(box[0].stop)
        whole_rows = _box_shape(box)[1:] == shape[1:]
        for block in range(first // block_rows, -(-stop // block_rows)):
            lo, hi = block * block_rows, min((block + 1) * block_rows, shape[0])
            gen = torch.Generator(device=device).manual_seed(_block_seed(seed, name, block))
            a, b = max(first, lo), min(stop, hi)
            if whole_rows and (a, b) == (lo, hi):  # the box holds the whole block: draw in place
                out[a - first : b - first].normal_(0.0, DUMMY_STD, generator=gen)
                continue
            values = torch.empty((hi - lo, *shape[1:]), device=device).normal_(0.0, DUMMY_STD, generator=gen)
            out[a - first : b - first] = values[(slice(a - lo, b - lo), *box[1:])]
        return out

    return LazyWeight.of(read, shape)


def _box_shape(box: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(int(s.stop) - int(s.start) for s in box)


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
