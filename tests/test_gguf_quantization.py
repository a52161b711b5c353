"""`--quantization gguf`: a GGUF file's Q4_0/Q4_1/Q8_0 blocks loaded straight into torch's
int4 layout. The reference everywhere is gguf-py's own dequantization of the same blocks.

The mapping onto int4 planes is exact (checked bit for bit in float); what the kernel
computes differs from it only by rounding each block's scale and zero to bfloat16
(relative 2^-9) and by bfloat16 activations and output (2^-9 each): an output error of
~0.3% of its norm, measured 0.26-0.31% for each of Q4_0, Q4_1 and Q8_0 on Gaussian
weights. The bounds leave ~30% headroom, so a misread block (one nibble order, one sign)
fails them by orders of magnitude.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from config.settings import SettingsError
from kernels.cpu import CpuOps
from runtime.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    QKVParallelLinear,
    RowParallelLinear,
)
from runtime.layers.quantization import (
    linear_form,
    prepare_linear_layers,
    quantize_linear_layers,
)
from runtime.layers.quantization.gguf import Int4PlanesLinearMethod
from runtime.layers.quantization.gguf_blocks import GgufTensor, GgufWeight, Int4Planes
from runtime.layers.quantization.int4 import Int4LinearMethod
from runtime.layers.weights import LazyWeight, ShardId
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import check_gguf_quantization, load_model
from runtime.model_executor.weight_utils import _unpermute_rows
from tests.test_models import randomize, run_in_rounds

KERNEL_REL = 0.004  # measured max 0.0031 over the shapes and types below
TYPES = ["Q4_0", "Q4_1", "Q8_0"]
SHAPES = [(64, 32), (576, 192), (1536, 64)]  # (in, out)


def qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def gguf_weight(w: torch.Tensor, kind: str, row_order: np.ndarray | None = None) -> GgufWeight:
    """`w [rows, cols]` quantized by gguf-py as llama.cpp would (rows stored as given)."""
    raw = gguf.quantize(w.float().numpy(), qtype(kind))
    return GgufWeight.of_tensor(GgufTensor(f"t.{kind}", qtype(kind), tuple(w.shape), raw, row_order))  # type: ignore[arg-type]


def reference(weight: GgufWeight) -> torch.Tensor:
    """gguf-py's dequantization of the whole stored tensor, in logical row order."""
    t = weight.tensor
    values = torch.from_numpy(gguf.dequantize(t.data, t.qtype).reshape(t.shape).copy())
    return values if t.row_order is None else values[torch.from_numpy(t.row_order)]


def gguf_layer(layer: LinearBase, parts: Mapping[ShardId, LazyWeight], ops: CpuOps | None = None) -> LinearBase:
    """Load `parts` (shard id -> checkpoint tensor) into `layer` as --quantization gguf does
    (with `ops`: as an engine with the CPU kernels bound does)."""
    holder = torch.nn.Sequential(layer)
    prepare_linear_layers(holder, "gguf", ops)
    assert layer.weight.device.type == "meta"  # a placeholder: no float storage
    for shard_id, weight in parts.items():
        layer.weight_loader(layer.weight, weight, shard_id)
    quantize_linear_layers(holder, "gguf")
    return layer


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


# --- (1) the block mapping is exact -------------------------------------------------------------


@pytest.mark.parametrize("kind", TYPES)
def test_int4_planes_are_exactly_ggufs_own_dequantization(kind: str) -> None:
    torch.manual_seed(0)
    weight = gguf_weight(torch.randn(48, 256) * 0.02, kind)
    planes = weight.int4_planes()
    assert planes.q.shape == ({"Q8_0": 2}.get(kind, 1), 48, 256) and int(planes.q.max()) <= 15
    assert torch.equal(planes.dequantize(), reference(weight))


@pytest.mark.parametrize("kind", TYPES)
def test_int4_planes_dequantize_exactly_at_every_magnitude(kind: str) -> None:
    """Rows from 1e-5 to 1e2, offset rows (Q4_1's m far from its d): the float32 path a
    Q4 plane takes (exact products, one rounded add) gives the bits of the planes' sum
    in float64 rounded once."""
    torch.manual_seed(1)
    rows = torch.randn(64, 512) * torch.logspace(-5, 2, 64)[:, None] + torch.logspace(-3, 1, 64).flip(0)[:, None]
    planes = gguf_weight(rows, kind).int4_planes()
    p, n, k = planes.q.shape
    groups = planes.q.double().view(p, n, k // 32, 32) - 8
    exact = (groups * planes.scale.double()[..., None] + planes.zero.double()[..., None]).sum(0).view(n, k)
    assert torch.equal(planes.dequantize(), exact.float())


@pytest.mark.parametrize("kind", TYPES)
def test_rows_and_aligned_columns_narrow_without_reading_the_rest(kind: str) -> None:
    weight = gguf_weight(torch.randn(64, 256), kind)
    part = weight.narrow(0, 16, 32).narrow(1, 64, 128)
    assert isinstance(part, GgufWeight) and part.packable
    assert torch.equal(part.int4_planes().dequantize(), reference(weight)[16:48, 64:192])
    inside_a_block = weight.narrow(1, 40, 100)  # not on block boundaries: float only
    assert isinstance(inside_a_block, GgufWeight) and not inside_a_block.packable
    assert torch.equal(inside_a_block.materialize(), reference(weight)[:, 40:140])


def test_row_order_undoes_llama_cpps_q_k_permutation() -> None:
    heads, head_dim = 3, 8
    hf = torch.randn(heads * head_dim, 64)
    # convert_hf_to_gguf.py's permute, as tests/test_models.py checks it on the real file.
    stored = hf.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(hf.shape)
    order = _unpermute_rows(hf.shape[0], heads)
    assert torch.equal(stored[torch.from_numpy(order)], hf)
    weight = gguf_weight(stored, "Q8_0", order)
    assert torch.equal(weight.int4_planes().dequantize(), reference(weight))
    assert torch.equal(weight.narrow(0, 8, 8).materialize(), reference(weight)[8:16])


# --- (2) the packed layer computes with those weights -------------------------------------------


@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("row", [False, True])
def test_packed_gguf_linear_equals_a_float_matmul_with_ggufs_dequantized_weight(k: int, n: int, kind: str, row: bool) -> None:
    torch.manual_seed(k + n)
    weight = gguf_weight(torch.randn(n, k) * 0.02, kind)
    layer = gguf_layer((RowParallelLinear if row else ColumnParallelLinear)(k, n), {None: weight})
    assert linear_form(layer) == ("int4x2" if kind == "Q8_0" else "int4")
    assert "weight" not in layer._parameters  # no float copy of the matrix
    x = torch.randn(5, k)
    with torch.no_grad():
        y = layer(x)
    assert y.dtype == x.dtype and y.shape == (5, n)
    assert rel_err(y, x @ reference(weight).T) < KERNEL_REL


@pytest.mark.parametrize("kind", TYPES)
def test_packed_weight_is_ggufs_up_to_bfloat16_scales(kind: str) -> None:
    weight = gguf_weight(torch.randn(32, 128) * 0.02, kind)
    layer = gguf_layer(ColumnParallelLinear(128, 32), {None: weight})
    method = layer.quant_method
    assert isinstance(method, Int4LinearMethod)
    planes = weight.int4_planes()
    bf16 = Int4Planes(planes.q, planes.scale.bfloat16().float(), planes.zero.bfloat16().float())
    assert torch.equal(method.dequantize(layer), bf16.dequantize())  # the packing itself is lossless
    assert rel_err(bf16.dequantize(), reference(weight)) < 0.0025  # bf16 scales: measured 0.0015-0.0018


def test_a_fused_layer_of_mixed_block_types_packs_as_two_planes() -> None:
    torch.manual_seed(1)
    layer = QKVParallelLinear(128, 32, total_num_heads=2, total_num_kv_heads=1)  # q 64 rows, k 32, v 32
    parts: dict[ShardId, GgufWeight] = {"q": gguf_weight(torch.randn(64, 128), "Q4_1"), "k": gguf_weight(torch.randn(32, 128), "Q8_0"),
             "v": gguf_weight(torch.randn(32, 128), "Q4_0")}  # fmt: skip
    gguf_layer(layer, parts)
    assert linear_form(layer) == "int4x2" and isinstance(layer.quant_method, Int4PlanesLinearMethod)
    x = torch.randn(3, 128)
    with torch.no_grad():
        y = layer(x)
    ref = x @ torch.cat([reference(parts[s]) for s in ("q", "k", "v")]).T
    assert rel_err(y, ref) < KERNEL_REL


def test_other_types_and_odd_shapes_fall_back_to_ggufs_float_values() -> None:
    torch.manual_seed(2)
    f16 = GgufWeight.of_tensor(GgufTensor("t.F16", qtype("F16"), (32, 64), torch.randn(32, 64).half().numpy()))
    layer = gguf_layer(ColumnParallelLinear(64, 32), {None: f16})
    assert linear_form(layer) == "float" and torch.equal(layer.weight, reference(f16))
    mixed = QKVParallelLinear(64, 16, total_num_heads=2, total_num_kv_heads=1)
    gguf_layer(mixed, {"q": gguf_weight(torch.randn(32, 64), "Q4_1"), "k": f16.narrow(0, 0, 16), "v": gguf_weight(torch.randn(16, 64), "Q8_0")})
    assert linear_form(mixed) == "float"  # one float part makes the whole layer float
    odd = gguf_weight(torch.randn(40, 64), "Q4_0")  # 40 rows: the int4 kernel wants a multiple of 16
    layer = gguf_layer(ColumnParallelLinear(64, 40), {None: odd})
    assert linear_form(layer) == "float" and torch.equal(layer.weight, reference(odd))
    plain = LazyWeight.from_tensor(torch.randn(32, 64))  # not from a GGUF at all
    layer = gguf_layer(ColumnParallelLinear(64, 32), {None: plain})
    assert linear_form(layer) == "float" and torch.equal(layer.weight, plain.materialize())


# --- (3) a tiny llama GGUF through load_model --------------------------------------------------

TINY_TYPES = {"q_proj": "Q4_1", "k_proj": "Q8_0", "v_proj": "Q4_0", "o_proj": "Q4_1", "gate_proj": "Q4_0", "up_proj": "Q4_1", "down_proj": "Q8_0"}
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An HF directory whose linear weights are the dequantized blocks of a GGUF file
    beside it (what `sluice prepare`'s conversion produces), layer 1's down_proj left F16."""
    path = tmp_path_factory.mktemp("tiny_gguf")
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf, seed=1)
    writer = gguf.GGUFWriter(path / "tiny.gguf", "llama")
    for i, layer in enumerate(hf.model.layers):
        for proj, kind in TINY_TYPES.items():
            module = getattr(layer.self_attn if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, proj)
            w = module.weight.data
            heads = {"q_proj": 4, "k_proj": 2}.get(proj)
            stored = w.reshape(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape) if heads else w
            if (i, proj) == (1, "down_proj"):
                kind, raw = "F16", stored.half().numpy()
            else:
                raw = gguf.quantize(stored.numpy(), qtype(kind))
            writer.add_tensor(f"blk.{i}.{GGUF_NAMES[proj]}.weight", raw, raw_dtype=qtype(kind))
            order = torch.from_numpy(_unpermute_rows(w.shape[0], heads)) if heads else slice(None)
            module.weight.data = torch.from_numpy(gguf.dequantize(raw, qtype(kind)).reshape(w.shape).copy())[order]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf.save_pretrained(path / "hf")
    return path / "hf", path / "tiny.gguf"


def test_tiny_gguf_model_packs_its_blocks_and_agrees_with_its_float_conversion(tiny_gguf: tuple[Path, Path]) -> None:
    model_dir, gguf_path = tiny_gguf
    config = ModelConfig.from_pretrained(model_dir, torch.float32)
    seq = torch.randint(0, 128, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    rounds = [[80], *[[1]] * 16]  # one extend, then decode steps (M = 1)
    ref = run_in_rounds(load_model(model_dir, config, "auto", "cpu", seed=None), config, [seq], rounds)[0]
    model = load_model(model_dir, config, "auto", "cpu", seed=None, quantization="gguf", gguf_path=gguf_path)
    forms = [linear_form(m) for m in model.modules() if isinstance(m, LinearBase)]
    assert forms == ["int4x2", "int4", "int4", "int4x2"] + ["int4x2", "int4", "int4", "float"]  # qkv, o, gate_up, down
    assert model.model.embed_tokens.weight.dtype == torch.float32  # embedding and LM head stay float
    logits = run_in_rounds(model, config, [seq], rounds)[0]
    # Same weights on both sides: only bfloat16 scales and activations differ, compounded
    # over 2 layers of nearly flat random logits. Measured over 3 sequences: top-1
    # agreement 0.99, logits 0.68-0.95% off.
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95
    assert rel_err(logits, ref) < 0.013


def test_gguf_quantization_refuses_what_it_cannot_read(tiny_gguf: tuple[Path, Path]) -> None:
    model_dir, gguf_path = tiny_gguf
    config = ModelConfig.from_pretrained(model_dir, torch.float32)
    with pytest.raises(SettingsError, match="needs a GGUF model"):
        load_model(model_dir, config, "auto", "cpu", seed=None, quantization="gguf")  # an HF directory
    with pytest.raises(SettingsError, match="CPU only"):
        check_gguf_quantization(model_dir, "auto", "cuda", gguf_path)
    with pytest.raises(SettingsError, match="load_format=dummy"):
        check_gguf_quantization(model_dir, "dummy", "cpu", gguf_path)
