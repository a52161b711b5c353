"""Where checkpoint tensors come from: safetensors files, or seeded dummy values.

Both yield `(HF name, LazyWeight)` with the full checkpoint shape; each parameter's
weight_loader narrows to its rank's part before anything is read, so a rank reads
(or generates) only its own slices and no rank ever holds the whole model. For
`--quantization gguf`, the linear layers' weights come from the GGUF file instead, as
`GgufWeight`s over its memory-mapped blocks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.layers.layernorm import RMSNorm
from runtime.layers.quantization.gguf_blocks import GgufTensor, GgufWeight
from runtime.layers.weights import LazyWeight, Shape
from runtime.model_config import ModelConfig
from runtime.models.llama import LlamaForCausalLM

DUMMY_STD = 0.02
DUMMY_BLOCK_ELEMENTS = 1 << 22  # dummy values are drawn in row blocks of about this many elements


class ModelNotFoundError(FileNotFoundError):
    """The model path (or the embedded default model) is not there."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "gguf"


@functools.lru_cache(maxsize=16)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:16]


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where a GGUF's conversion lives (model_loader.prepare_model_dir): keyed by its content."""
    st = gguf_path.stat()
    return cache_root() / _file_digest(str(gguf_path.resolve()), st.st_size, st.st_mtime_ns)


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


def iter_safetensors_with_gguf(
    model_dir: Path, gguf_path: Path, gguf_names: set[str], config: ModelConfig
) -> Iterator[tuple[str, LazyWeight]]:
    """`iter_safetensors(model_dir)` (the GGUF's conversion), except that the tensors
    named in `gguf_names` come from `gguf_path` itself, in their own encoding."""
    tensors = gguf_tensors(gguf_path, gguf_names, config)
    for name, weight in iter_safetensors(model_dir):
        yield name, GgufWeight.of_tensor(tensors[name]) if name in tensors else weight


def gguf_tensors(gguf_path: Path, hf_names: set[str], config: ModelConfig) -> dict[str, GgufTensor]:
    """The GGUF tensors behind HF checkpoint names, through gguf-py's own name map (the
    one llama.cpp's converter wrote them with). The converter permutes llama's q and k
    rows for its interleaved rope; `row_order` undoes that as transformers does (for the
    `llama` architecture only), so rows are in HF order whatever their encoding."""
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map

    table = gguf_tensor_table(gguf_path)
    arch_name = table.architecture
    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ValueError(f"{gguf_path.name}: architecture {arch_name!r} is unknown to gguf-py")
    name_map = get_tensor_name_map(arch, config.num_layers)
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r").view(np.ndarray)  # (numpy slices a plain view faster)
    out: dict[str, GgufTensor] = {}
    for hf_name in sorted(hf_names):
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{name_map.get_name(base)}.{suffix}"
        if gguf_name not in table.tensors:
            raise ValueError(f"{hf_name}: {gguf_path.name} has no tensor {gguf_name!r}")
        t = table.tensors[gguf_name]
        rows, cols = t.rows_cols
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(gguf_name.split(".")[-2])
        order = _unpermute_rows(rows, heads) if arch_name == "llama" and heads else None
        array = data[t.offset : t.offset + t.n_bytes].view(np.dtype(t.dtype)).reshape(rows, -1)
        out[hf_name] = GgufTensor(gguf_name, GGMLQuantizationType(t.qtype), (rows, cols), array, order)
    return out


@dataclass(frozen=True, slots=True)
class GgufTableEntry:
    """Where one tensor's data lies in its GGUF file, as gguf-py's reader found it."""

    qtype: int  # GGMLQuantizationType
    dims: tuple[int, ...]  # GGUF's order (columns first)
    dtype: str  # the numpy dtype gguf-py reads it as (uint8 bytes for a block type)
    offset: int  # from the start of the file
    n_bytes: int

    @property
    def rows_cols(self) -> tuple[int, int]:
        rows, cols = (int(n) for n in reversed(self.dims))
        return rows, cols


@dataclass(frozen=True, slots=True)
class GgufTable:
    architecture: str
    tensors: dict[str, GgufTableEntry]


GGUF_TABLE_VERSION = 1


def gguf_tensor_table(path: Path) -> GgufTable:
    """The architecture and tensor table of the GGUF at `path`. gguf-py's reader parses
    the whole header, a 49k-token vocabulary's ~250k metadata items included (2.4 s on a
    Zen 1 EPYC, the biggest part of a start's model load); the table it gives is kept
    beside the file's conversion (keyed by the file's content digest), so later loads
    read a small JSON file instead."""
    cached = gguf_cache_dir(path)
    cached = cached.with_name(f"{cached.name}.tensors.json")
    try:
        raw = json.loads(cached.read_text())
        if raw.get("version") == GGUF_TABLE_VERSION:
            tensors = {n: GgufTableEntry(e["qtype"], tuple(e["dims"]), e["dtype"], e["offset"], e["n_bytes"]) for n, e in raw["tensors"].items()}
            return GgufTable(raw["architecture"], tensors)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not written yet, or unreadable: parse the header
    reader = open_gguf(path)
    field = reader.fields["general.architecture"]
    table = GgufTable(
        bytes(field.parts[field.data[0]]).decode(),
        {t.name: GgufTableEntry(int(t.tensor_type), tuple(int(n) for n in t.shape.tolist()), t.data.dtype.str,
                                int(t.data_offset), int(t.n_bytes)) for t in reader.tensors},
    )  # fmt: skip
    raw_out = {"version": GGUF_TABLE_VERSION, "architecture": table.architecture,
               "tensors": {n: {"qtype": e.qtype, "dims": list(e.dims), "dtype": e.dtype, "offset": e.offset,
                               "n_bytes": e.n_bytes} for n, e in table.tensors.items()}}  # fmt: skip
    with contextlib.suppress(OSError):  # a read-only cache: parse again next time
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
        tmp.write_text(json.dumps(raw_out))
        os.replace(tmp, cached)
    return table


def open_gguf(path: Path) -> Any:
    """gguf-py's `GGUFReader` over `path`: the file is memory-mapped, only the header is
    parsed. The reader slices its `np.memmap` once per metadata item (~250k of them for
    a 49k-token vocabulary), and numpy's memmap bookkeeping per slice costs 2-3 s here;
    `_ArrayReader` slices a plain ndarray view of the same mapping instead (4x faster),
    and the stock reader is the fallback should gguf-py's private `_get` change."""
    from gguf import GGUFReader

    class _ArrayReader(GGUFReader):  # type: ignore[misc]
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            if "_array" not in self.__dict__:
                self._array = self.data.view(np.ndarray)
            count = int(count)
            arr = self._array[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    try:
        return _ArrayReader(path)
    except (TypeError, AttributeError):
        return GGUFReader(path)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """HF row r is GGUF row order[r]: within each head, llama.cpp interleaves rows
    (i, i + D/2) into (2i, 2i + 1) (convert_hf_to_gguf.py's `permute`)."""
    return np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


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
