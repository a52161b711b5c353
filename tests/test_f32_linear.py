"""The float32 dense path of the quantized linears on AVX2 CPUs (kernels/cpu/f32_linear.cpp):
prefill and batches of dense_min_rows rows or more, where bfloat16 is not native.

What it computes is fixed exactly: y[m, n] = sum over k, in order, of one fused
multiply-add each in float32. Against the product in float64 it differs only by that
float32 accumulation; a row's bits never depend on the other rows of the call. Without
AVX2 the same operations run lane by lane (std::fma), so these tests hold on any CPU;
only the engine's choice of the form depends on the flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.cpu import CpuOps
from runtime.layers.quantization.int4 import pack_f32_panels
from runtime.layers.quantization.q4q8 import pack_q4
from runtime.layers.quantization.q8 import Q8Weight, pack_q8_vnni


def float32_sums_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 sums of K products: a few ulps of the sum of their magnitudes."""
    return 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-30


# M covers a lone row, every short 6-row tile, and at K = 1536 more than one row block
# (kBlockBytes); K = 33 is no multiple of any vector; N = 16 is one panel, 48 three (a
# panel split unevenly over 2 threads).
@pytest.mark.parametrize("M", [1, 5, 6, 7, 64, 257])
@pytest.mark.parametrize("N,K", [(16, 33), (48, 576), (192, 1536), (960, 576)])
def test_the_float32_product_summed_in_order(cpu_ops: CpuOps, M: int, N: int, K: int) -> None:
    torch.manual_seed(M * 13 + N + K)
    x, w = torch.randn(M, K), torch.randn(N, K) * 0.05
    y = cpu_ops.f32_linear(x, pack_f32_panels(w))
    assert y.dtype == torch.float32 and y.shape == (M, N) and y.is_contiguous()
    assert ((y.double() - x.double() @ w.double().T).abs() <= float32_sums_bound(x, w)).all()


def test_a_row_gets_the_same_bits_alone_and_in_any_batch(cpu_ops: CpuOps) -> None:
    x, panels = torch.randn(300, 1536), pack_f32_panels(torch.randn(96, 1536))
    full = cpu_ops.f32_linear(x, panels)
    for rows in (slice(0, 1), slice(3, 20), slice(31, 38), slice(100, 300)):
        assert torch.equal(cpu_ops.f32_linear(x[rows].clone(), panels), full[rows])


# Q4_1 / Q8_0 blocks kept as the kernels' records (pack_q4, pack_q8_vnni) are read as
# panels, each dequantized as the loop reaches it: the bits of panels of the file's float32
# weights (gguf's dequantization: d q + m, d q), at scales from 1e-5 to 1e2, over one row
# block and several (M = 200 at K = 1536).
@pytest.mark.parametrize("M", [1, 7, 200])
@pytest.mark.parametrize("K", [64, 1536])
def test_q4_and_q8_records_give_the_bits_of_panels_of_their_float32_weights(cpu_ops: CpuOps, M: int, K: int) -> None:
    torch.manual_seed(M + K)
    n, groups = 48, K // 32
    scale = 10.0 ** torch.randint(-5, 3, (n, groups)).float()
    d = (torch.rand(n, groups) * scale).half()
    m = ((torch.rand(n, groups) - 0.7) * 8 * scale).half()
    q4 = torch.randint(0, 16, (n, K), dtype=torch.uint8)
    w4 = (q4.float().view(n, groups, 32) * d.float()[..., None] + m.float()[..., None]).view(n, K)
    q8 = torch.randint(-127, 128, (n, K), dtype=torch.int8)
    d8 = d.float()
    w8 = (q8.float().view(n, groups, 32) * d8[..., None]).view(n, K)
    blocks = Q8Weight(q8.view(n // 16, 16, K).transpose(1, 2).contiguous(), d8.view(n // 16, 16, groups).transpose(1, 2).contiguous())
    x = torch.randn(M, K)
    assert torch.equal(cpu_ops.f32_linear(x, pack_q4(q4, d, m)), cpu_ops.f32_linear(x, pack_f32_panels(w4)))
    assert torch.equal(cpu_ops.f32_linear(x, pack_q8_vnni(blocks)), cpu_ops.f32_linear(x, pack_f32_panels(w8)))


def test_a_strided_x_and_zero_rows(cpu_ops: CpuOps) -> None:
    w = torch.randn(32, 64)
    x = torch.randn(10, 128)[:, ::2]  # a view with column stride 2
    assert not x.is_contiguous()
    assert torch.equal(cpu_ops.f32_linear(x, pack_f32_panels(w)), cpu_ops.f32_linear(x.contiguous(), pack_f32_panels(w)))
    assert cpu_ops.f32_linear(torch.empty(0, 64), pack_f32_panels(w)).shape == (0, 32)


def test_the_panel_layout_puts_each_weight_where_the_kernel_reads_it() -> None:
    w = torch.arange(32 * 5, dtype=torch.float32).view(32, 5)
    p = pack_f32_panels(w)
    assert p.shape == (2, 5, 16)
    for n, k, j in [(0, 0, 0), (1, 4, 15), (0, 3, 7), (1, 1, 2)]:
        assert p[n, k, j] == w[16 * n + j, k]


def test_mismatched_shapes_are_refused(cpu_ops: CpuOps) -> None:
    panels = pack_f32_panels(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="K must be"):
        cpu_ops.f32_linear(torch.randn(3, 65), panels)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.f32_linear(torch.randn(3, 64).bfloat16(), panels)
    with pytest.raises(RuntimeError, match="pack_f32_panels"):
        cpu_ops.f32_linear(torch.randn(3, 64), torch.randn(64, 32))


def test_the_engine_form_exactly_where_the_cpu_has_avx2_and_no_avx512(cpu_ops: CpuOps) -> None:
    """An AVX-512 build leaves float32 GEMMs to oneDNN (which has the wider form; and those
    CPUs' dense copies are bfloat16 where native); AVX2 with FMA runs this kernel's ymm loop."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if not flags:
        pytest.skip("no /proc/cpuinfo to read the CPU flags from")
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
    assert cpu_ops.f32_linear_isa() == ("avx2" if not avx512 and {"avx2", "fma"} <= flags else "")


def float32_linears_beside_a_bf16_one(a_rows: int, **more: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A module of linears: `a` (576 -> a_rows, with a bias), one 64 -> rows float32 layer per
    `more` entry, and `bf16` (64 -> 32, bfloat16); random weights. Returns it with copies of
    a's weight and bias."""
    from runtime.layers.linear import ColumnParallelLinear

    model = torch.nn.Module()
    model.a = ColumnParallelLinear(576, a_rows, bias=True)
    for name, rows in more.items():
        setattr(model, name, ColumnParallelLinear(64, rows))
    model.bf16 = ColumnParallelLinear(64, 32)
    for layer in model.children():
        torch.nn.init.normal_(layer.weight, std=0.05)
    model.bf16.weight.data = model.bf16.weight.data.bfloat16()
    torch.nn.init.normal_(model.a.bias)
    return model, model.a.weight.detach().clone(), model.a.bias.detach().clone()


def check_repacked(layer: torch.nn.Module, method_type: type, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A repacked float32 linear: its method gives `weight` back exactly, and on a random
    [2, 7, 576] input it computes x @ W.T + bias within float32 sums' bound; (x, y)."""
    method = layer.quant_method
    assert isinstance(method, method_type) and torch.equal(method.dequantize(layer), weight)
    x = torch.randn(2, 7, 576)
    with torch.no_grad():
        y = layer(x)
    rows = weight.shape[0]
    assert y.shape == (2, 7, rows)
    err = ((y - bias).double() - x.double() @ weight.double().T).abs()
    assert err.le(float32_sums_bound(x.reshape(14, 576), weight).view(2, 7, rows)).all()
    return x, y


def test_unquantized_float32_linears_move_onto_the_panels_where_the_kernel_has_avx2(cpu_ops: CpuOps) -> None:
    """runtime.models.cpu_path.use_f32_panels: a float32 linear whose output rows are whole
    panels computes on them (the plain weight goes, the panels hold it exactly), with its
    bias and any leading dims; other rows counts and dtypes keep F.linear."""
    from runtime.layers.linear import F32PanelsLinearMethod, UnquantizedLinearMethod
    from runtime.layers.quantization import linear_form
    from runtime.models.cpu_path import use_f32_panels

    torch.manual_seed(4)
    model, weight, bias = float32_linears_beside_a_bf16_one(192, odd=40)  # 40 rows: no whole panels
    moved = use_f32_panels(model, cpu_ops)
    if not cpu_ops.f32_linear_isa():
        assert moved == 0 and all(type(m.quant_method) is UnquantizedLinearMethod for m in (model.a, model.odd))
        return
    assert moved == 1 and linear_form(model.a) == "float-panels" and not hasattr(model.a, "weight")
    assert linear_form(model.odd) == "float" and linear_form(model.bf16) == "float"
    x, y = check_repacked(model.a, F32PanelsLinearMethod, weight, bias)
    assert torch.equal(y, cpu_ops.f32_linear(x.reshape(14, 576), pack_f32_panels(weight)).view(2, 7, 192) + bias)


def test_without_the_panels_float32_linears_take_onednns_packed_copy(cpu_ops: CpuOps) -> None:
    """runtime.models.cpu_path.use_onednn_packed (AVX-512 CPUs, where f32_linear is not
    built): every float32 linear's weight becomes oneDNN's packed copy, which gives the
    weight back exactly and computes x @ W.T + bias with float32 sums; other dtypes stay."""
    from runtime.layers.linear import OneDnnPackedLinearMethod
    from runtime.layers.quantization import linear_form
    from runtime.models.cpu_path import use_onednn_packed

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch was built without oneDNN")
    torch.manual_seed(5)
    model, weight, bias = float32_linears_beside_a_bf16_one(200)  # any row count: oneDNN needs no panels
    assert use_onednn_packed(model) == 1
    assert linear_form(model.a) == "float-onednn" and not hasattr(model.a, "weight") and linear_form(model.bf16) == "float"
    check_repacked(model.a, OneDnnPackedLinearMethod, weight, bias)


def test_a_float32_model_bound_to_the_kernels_runs_its_linears_and_head_on_panels_and_equals_hf(
    cpu_ops: CpuOps, tokenizer: Any, tmp_path: Path
) -> None:
    """bind_cpu_ops on an unquantized float32 checkpoint (a float head, not Q8-exact): the
    linears and the head take f32_linear's panels where it has its AVX2 form (the head at
    every row count, under deterministic inference too), and the logits stay HF's."""
    from transformers import AutoModelForCausalLM

    from bench.paged_rounds import teacher_forced
    from runtime.layers.linear import LinearBase
    from runtime.layers.quantization import linear_form
    from runtime.model_config import ModelConfig
    from runtime.model_executor.model_loader import load_model
    from runtime.models.cpu_path import bind_cpu_ops, make_batch_invariant
    from tests.tiny_checkpoints import make_llama_checkpoint

    path = make_llama_checkpoint(tmp_path / "ck", tokenizer, num_kv_heads=2)
    model = load_model(path, ModelConfig.from_pretrained(path, torch.float32), "auto", "cpu", seed=None)
    bound = bind_cpu_ops(model, cpu_ops)
    head = model.logits_processor
    on_panels = bool(cpu_ops.f32_linear_isa())
    assert ("lm_head_panels" in bound) == on_panels == (head.panels is not None)
    off_panels = "float-onednn" if torch.backends.mkldnn.is_available() else "float"
    assert {linear_form(m) for m in model.modules() if isinstance(m, LinearBase)} == {"float-panels" if on_panels else off_panels}
    hidden = torch.randn(5, 64)
    with torch.no_grad():
        logits = head(hidden, model.lm_head)
        if on_panels:
            assert torch.equal(logits, cpu_ops.f32_linear(hidden, head.panels))
            make_batch_invariant(model)
            assert torch.equal(head(hidden[2:3], model.lm_head)[0], logits[2])  # the same kernel, alone
        torch.testing.assert_close(logits.double(), hidden.double() @ model.lm_head.weight.double().T, rtol=1e-5, atol=1e-5)
    ids = tokenizer.encode("The river rose slowly through the night")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], dim=-1)
    ours = teacher_forced(model, ModelConfig.from_pretrained(path, torch.float32), [ids], decode_steps=4)
    assert (ours.log_softmax(-1) - ref).abs().max() < 1e-4
