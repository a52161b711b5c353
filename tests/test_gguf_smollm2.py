"""`--quantization gguf` on the embedded SmolLM2-135M-Instruct Q4_1 GGUF (slow: every
test reads the real file; tests/conftest.py lists this file in SLOW_TESTS).

The file holds 210 Q4_1 linear weights, a Q8_0 token embedding (tied to the LM head,
kept float) and F32 norms. Its float32 conversion, the reference here, is the same
blocks dequantized, so the packed model differs from it only by bfloat16 scales and
activations in the linear layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from bench.paged_rounds import teacher_forced
from bench.quant_model import HELD_OUT_TEXT, agreement
from runtime.layers.linear import LinearBase
from kernels.cpu import load_cpu_ops
from runtime.layers.quantization import linear_form
from runtime.layers.quantization.gguf_blocks import GgufWeight
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import (
    default_model_path,
    gguf_source,
    load_model,
)
from runtime.model_executor import weight_utils
from runtime.model_executor.weight_utils import gguf_cache_dir, gguf_tensor_table, gguf_tensors
from tests.conftest import assert_all_memory_free

# Teacher-forced over the 222 tokens of HELD_OUT_TEXT (two windows, each 16 decode steps
# after one prefill), float32 model, against the float32 conversion: measured top-1
# agreement 0.991 (2 tokens differ) and mean |delta logprob| 0.013 (int4 from the float
# weights: 0.982 and 0.020; a bfloat16 model without quantization: 0.977 and 0.027).
TOP1_AGREEMENT = 0.97
MEAN_ABS_DLOGPROB = 0.02


def test_the_embedded_gguf_linear_weights_read_exactly_as_their_float_conversion(model_dir: Path) -> None:
    assert gguf_source(model_dir) == default_model_path()
    config = ModelConfig.from_pretrained(model_dir, torch.float32)
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = {n for n in f.keys() if n.endswith("_proj.weight")}  # noqa: SIM118 (safe_open is no dict)
        tensors = gguf_tensors(default_model_path(), names, config)
        assert len(tensors) == 210 and {t.qtype.name for t in tensors.values()} == {"Q4_1"}
        for name, tensor in tensors.items():  # the q/k rows too: llama.cpp's permutation is undone
            assert torch.equal(GgufWeight.of_tensor(tensor).materialize(), f.get_tensor(name)), name


def test_the_tensor_table_is_gguf_pys_and_read_back_without_parsing_the_header(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load reads the GGUF's tensor table from a JSON file beside its conversion once a
    first load wrote it (gguf-py's header parse is 2.4 s on a Zen 1); the arrays are the
    reader's own, byte for byte. A damaged table is parsed again and rewritten."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = default_model_path()
    table_file = gguf_cache_dir(source).with_name(f"{gguf_cache_dir(source).name}.tensors.json")
    assert not table_file.exists()
    first = gguf_tensor_table(source)
    assert table_file.is_file()
    parses: list[Path] = []
    parse = weight_utils.open_gguf
    monkeypatch.setattr(weight_utils, "open_gguf", lambda path: parses.append(path) or parse(path))
    again = gguf_tensor_table(source)
    assert again == first and parses == []  # read back, not parsed
    reader = parse(source)  # gguf-py's reader (open_gguf: its GGUFReader, slicing a plain view of the map)
    assert first.architecture == "llama" and set(first.tensors) == {t.name for t in reader.tensors}
    config = ModelConfig.from_pretrained(model_dir, torch.float32)  # (the real cache's conversion)
    names = {"model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"}
    ours = gguf_tensors(source, names, config)
    by_name = {t.name: t for t in reader.tensors}
    for tensor in ours.values():
        theirs = by_name[tensor.name]
        assert tensor.qtype == theirs.tensor_type and tensor.data.dtype == theirs.data.dtype
        assert np.array_equal(tensor.data, theirs.data.reshape(tensor.shape[0], -1)), tensor.name
    table_file.write_text("{\"version\": 1, \"tensors\": ")  # cut short
    assert gguf_tensor_table(source) == first and parses == [source]
    assert gguf_tensor_table(source) == first and parses == [source]  # rewritten whole


def test_gguf_model_agrees_with_float32_teacher_forced(model_dir: Path, tokenizer: Any) -> None:
    config = ModelConfig.from_pretrained(model_dir, torch.float32, context_length=512)
    ids = tokenizer.encode(HELD_OUT_TEXT)
    windows = [ids[:128], ids[128:]]

    ref = teacher_forced(load_model(model_dir, config, "auto", "cpu", seed=None), config, windows)
    model = load_model(model_dir, config, "auto", "cpu", seed=None, quantization="gguf")
    forms = [linear_form(m) for m in model.modules() if isinstance(m, LinearBase)]
    assert forms == ["int4"] * 120  # 30 layers x (qkv, o, gate_up, down), every one packed
    top1, dlogprob = agreement(teacher_forced(model, config, windows), ref)
    print(f"gguf vs float32 over {len(ids)} tokens: top-1 agreement {top1:.3f}, mean |delta logprob| {dlogprob:.4f}")
    assert top1 >= TOP1_AGREEMENT and dlogprob <= MEAN_ABS_DLOGPROB, (top1, dlogprob)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_gguf_quantization_generates_greedy_text(dtype: str, make_module_engine: Any, tokenizer: Any) -> None:
    engine = make_module_engine(quantization="gguf", dtype=dtype)
    ops = load_cpu_ops()  # with the kernels on a VNNI CPU the Q4_1 layers run q4q8, else torch's int4
    packed = "q4q8" if ops is not None and ops.q4_linear_isa() else "int4"
    assert {linear_form(m) for m in engine.worker.model.modules() if isinstance(m, LinearBase)} == {packed}
    greedy = {"max_new_tokens": 8, "temperature": 0}
    out = engine.generate("The capital of France is", greedy)
    assert "Paris" in out["text"], out["text"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}], tokenize=False, add_generation_prompt=True)
    outs = engine.generate([chat, chat], {**greedy, "max_new_tokens": 16})
    assert outs[0]["output_ids"] == outs[1]["output_ids"] and outs[0]["text"].strip()  # greedy: one answer
    assert_all_memory_free(engine)
