"""Q4 blocks x int8 activations (kernels/cpu/q4_linear.cpp, runtime/layers/quantization/q4q8.py):
a GGUF's Q4_0/Q4_1 linear layers as the engine runs them on an AVX512-VNNI or AVX2 CPU.

What the kernel computes is fixed exactly: the file's weights `d * q + m` (fp16 d and m,
kept as they are) against each activation row rounded per 32 columns to the 16-bit
fixed point `u * (256 a + b)` (two int8 planes). Against that reference, in float64, the
kernel differs only by float32 accumulation (measured <= 2.2e-6 of the output's largest
value); against the float matmul the activation rounding adds ~6e-5 (bfloat16
activations: ~4e-3). AVX2 computes the same integers with other instructions and the same
float steps (the same bits), and a CPU with neither runs it lane by lane, so these tests
hold on any CPU; only the engine's choice of the form depends on the flags.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.cpu import CpuOps
from runtime.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from runtime.layers.quantization import linear_form, q4q8, settle_dense_min_rows
from runtime.layers.quantization import gguf
from runtime.layers.quantization.gguf import dense_dtype, native_bf16_matmul
from runtime.layers.quantization.int4 import DENSE_COPIES, pack_f32_panels
from runtime.layers.quantization.q4q8 import (
    DENSE_MIN_ROWS_FLOAT32,
    DENSE_MIN_ROWS_PANELS,
    Q4Q8LinearMethod,
    dense_min_rows,
    pack_q4,
    unpack_q4,
)
from runtime.layers.quantization.q8 import pack_q8_exact, pack_q8_vnni
from tests.test_gguf_quantization import gguf_layer, gguf_weight, reference, rel_err

SHAPES = [(1, 16, 32), (3, 576, 576), (7, 960, 576), (16, 576, 1536), (37, 48, 96)]  # (M, N, K)


def random_blocks(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    return q, (torch.rand(n, k // 32) * 0.01).half(), (-torch.rand(n, k // 32) * 0.08).half()


def fixed_point(x: torch.Tensor) -> torch.Tensor:
    """Each row of `x` as the kernel rounds it, per 32 columns: float64 `u * (256 a + b)`."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    t = blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    a = torch.round(t)
    b = torch.round(256 * (t - a)).clamp(max=127)
    return ((256 * a + b).double() * (amax / 127 / 256).double()).view(m, k)


def test_packing_round_trips_codes_and_scales_exactly() -> None:
    q, d, m = random_blocks(48, 96)
    records = pack_q4(q, d, m)
    assert records.shape == (3, 3, 320) and records.dtype == torch.uint8
    back = unpack_q4(records)
    assert all(torch.equal(x, y) for x, y in zip(back, (q, d, m), strict=True))
    with pytest.raises(ValueError):
        pack_q4(q[:40], d[:40], m[:40])  # 40 rows: not whole 16-row blocks


@pytest.mark.parametrize(("M", "N", "K"), SHAPES)
def test_kernel_is_the_fixed_point_product_with_the_blocks(cpu_ops: CpuOps, M: int, N: int, K: int) -> None:
    torch.manual_seed(M * N + K)
    q, d, m = random_blocks(N, K)
    x = torch.randn(M, K)
    x[:, 3] *= 40  # an outlier channel, as hidden states have: its block's scale grows
    y = cpu_ops.q4_linear(x, pack_q4(q, d, m))
    w = (q.double().view(N, K // 32, 32) * d.double()[..., None] + m.double()[..., None]).view(N, K)
    ref = fixed_point(x) @ w.T
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert ((y.double() - x.double() @ w.T).abs().max() / ref.abs().max()).item() < 3e-4


@pytest.mark.parametrize(("M", "K"), [(1, 32), (5, 576), (16, 1536), (9, 32 * 37)])
def test_every_activation_column_and_group_sum_reaches_the_output_exactly(cpu_ops: CpuOps, M: int, K: int) -> None:
    """The rounding pinned bit for bit: output n reads column n alone (code 1, d = 1, m = 0),
    so it is float32(u * (256 a + b)) of that column; output K + g reads group g's sum alone
    (d = 0, m = 1), float32(u * sum(256 a + b)). Groups whose 32 columns hold zeros, an
    outlier, values far apart in magnitude and ties of the rounding all appear."""
    torch.manual_seed(K + M)
    x = torch.randn(M, K) * torch.logspace(-3, 3, M)[:, None]
    x[:, 3] *= 40
    x[0, 32:64] = 0.0  # an all-zero group (where there is one)
    # a group whose scale is 1 (max 127): ties of a (x.5) and of b (256 (t - a) = k.5), to even
    x[-1, :32] = 0.0
    x[-1, :9] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1 + 3 / 512, -5 - 7 / 512, 100 + 1 / 512, -(1 / 512)])
    G = K // 32
    n = (K + G + 15) // 16 * 16
    q = torch.zeros(n, K, dtype=torch.uint8)
    q[torch.arange(K), torch.arange(K)] = 1
    d = torch.zeros(n, G, dtype=torch.float16)
    d[:K] = 1.0
    m = torch.zeros(n, G, dtype=torch.float16)
    m[K + torch.arange(G), torch.arange(G)] = 1.0
    y = cpu_ops.q4_linear(x, pack_q4(q, d, m))
    blocks = x.view(M, G, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    # (127 / amax as a division: torch's `127 / tensor` multiplies by a reciprocal)
    t = blocks * torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    a = torch.round(t)
    b = torch.round(256 * (t - a)).clamp(max=127)
    u = amax / 127 / 256  # float32, as the kernel's
    assert torch.equal(y[:, :K], ((256 * a + b) * u).view(M, K))
    assert torch.equal(y[:, K : K + G], u[..., 0] * (256 * a + b).sum(-1))


def test_a_row_gets_the_same_bits_alone_and_anywhere_in_any_batch(cpu_ops: CpuOps) -> None:
    torch.manual_seed(0)
    records = pack_q4(*random_blocks(576, 576))
    x = torch.randn(21, 576)
    probe = torch.randn(576)
    alone = cpu_ops.q4_linear(probe[None], records)[0]
    for rows, at in [(2, 1), (4, 3), (5, 4), (7, 5), (13, 0), (21, 10)]:  # every tile remainder and place
        batch = x[:rows].clone()
        batch[at] = probe
        assert torch.equal(cpu_ops.q4_linear(batch, records)[at], alone), (rows, at)


def test_the_kernel_runs_on_the_best_integer_products_the_cpu_flags_offer(cpu_ops: CpuOps) -> None:
    """The build is -march=native: AVX512-VNNI's vpdpbusd where the CPU has it, else AVX2's
    vpmaddubsw / vpmaddwd (AMD Zen 2, Intel before Ice Lake), else the scalar loop, which the
    engine does not pick (gguf falls back to torch's int4 kernel there)."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if not flags:
        pytest.skip("no /proc/cpuinfo to read the CPU flags from")
    expected = "avx512-vnni" if {"avx512f", "avx512bw", "avx512_vnni"} <= flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else ""
    assert cpu_ops.q4_linear_isa() == expected


def test_zero_rows_and_zero_blocks_give_exact_zeros_plus_the_min_term(cpu_ops: CpuOps) -> None:
    q, d, m = random_blocks(16, 64)
    x = torch.zeros(2, 64)
    x[1, 40] = 1.0  # block 1 holds one value; block 0 is all zeros (scale 0, no division)
    y = cpu_ops.q4_linear(x, pack_q4(q, d, m))
    assert torch.equal(y[0], torch.zeros(16))
    w = q[:, 40].double() * d[:, 1].double() + m[:, 1].double()
    assert torch.allclose(y[1].double(), w, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("row", [False, True])
def test_a_gguf_layer_packs_the_files_blocks_exactly_and_computes_with_them(cpu_ops: CpuOps, kind: str, row: bool) -> None:
    torch.manual_seed(7)
    weight = gguf_weight(torch.randn(192, 576) * 0.02, kind)
    layer = gguf_layer((RowParallelLinear if row else ColumnParallelLinear)(576, 192), {None: weight}, cpu_ops)
    # The engine takes this form exactly where the kernels run Q4 blocks (AVX512-VNNI or AVX2);
    # elsewhere torch's int4.
    assert linear_form(layer) == ("q4q8" if cpu_ops.q4_linear_isa() else "int4")
    if not cpu_ops.q4_linear_isa():
        return
    method = layer.quant_method
    assert isinstance(method, Q4Q8LinearMethod) and "weight" not in layer._parameters
    assert torch.equal(method.dequantize(layer), reference(weight))  # d and m are the file's, bit for bit
    x = torch.randn(5, 576, dtype=torch.float64).float()
    with torch.no_grad():
        y = layer(x)
    assert y.dtype == x.dtype and rel_err(y, x @ reference(weight).T) < 2e-4  # bf16 activations: ~3e-3
    # A prefill-sized batch goes through the dense copy: with AMX or AVX512-BF16 as the kernels'
    # bfloat16 tiles, float32 out (the bf16 operands' exact products summed in float32); in
    # float32 where bf16 matmuls are not native (the file's weights, each rounded once), as the
    # kernels' f32_linear panels on AVX2; else in oneDNN's blocked layout (re-packed per call
    # otherwise), bfloat16 where native (output rounded to bf16).
    big = torch.randn(dense_min_rows(layer) + 9, 576)
    with torch.no_grad():
        y = layer(big)
    assert hasattr(layer, "dense_tiles") == bool(cpu_ops.bf16_linear_isas())
    dense = dense_dtype(torch.device("cpu"), 192 * 576)
    if hasattr(layer, "dense_tiles"):
        exact = big.bfloat16().double() @ reference(weight).bfloat16().double().T
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-6)
    elif dense == torch.bfloat16:
        assert layer.dense_packed.dtype == torch.bfloat16
        bf16 = torch.nn.functional.linear(big.bfloat16(), reference(weight).bfloat16()).float()
        torch.testing.assert_close(y, bf16, rtol=2**-7, atol=1e-5)  # one bf16 rounding of the sums
    else:
        assert dense == torch.float32
        if cpu_ops.f32_linear_isa():  # the records read as panels of the file's float32 weights
            assert torch.equal(y, cpu_ops.f32_linear(big, pack_f32_panels(reference(weight))))
        else:
            assert layer.dense_packed.dtype == torch.float32
        torch.testing.assert_close(y.double(), big.double() @ reference(weight).double().T, rtol=1e-5, atol=1e-5)
    assert rel_err(y, big @ reference(weight).T) < 1e-2


def test_without_native_bf16_a_model_over_the_float32_budget_keeps_no_dense_copy(
    cpu_ops: CpuOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 copy is 8x a Q4 layer's bytes: past DENSE_FLOAT32_MAX_BYTES for the whole
    model none is kept. Where f32_linear has its AVX2 form, prefill-sized batches then read
    the records as panels (the copy's bits, no copy); elsewhere they run on the blocks, as
    exactly as decodes."""
    if native_bf16_matmul(torch.device("cpu")) or not cpu_ops.q4_linear_isa():
        pytest.skip("bfloat16 copies (native here) have no budget; without Q4 kernels the layer is int4")
    torch.manual_seed(5)
    weight = gguf_weight(torch.randn(192, 576) * 0.02, "Q4_1")
    monkeypatch.setattr(gguf, "DENSE_FLOAT32_MAX_BYTES", 4 * 192 * 576 - 1)
    layer = gguf_layer(ColumnParallelLinear(576, 192), {None: weight}, cpu_ops)
    big = torch.randn(max(DENSE_MIN_ROWS_FLOAT32, DENSE_MIN_ROWS_PANELS) + 9, 576)
    with torch.no_grad():
        y = layer(big)
    monkeypatch.setattr(gguf, "DENSE_FLOAT32_MAX_BYTES", 4 * 192 * 576)
    kept = gguf_layer(ColumnParallelLinear(576, 192), {None: weight}, cpu_ops)
    if cpu_ops.f32_linear_isa():
        assert [name for name in DENSE_COPIES if hasattr(layer, name)] == ["dense_panels"]
        assert layer.dense_panels.data_ptr() == layer.q4_weight.data_ptr()  # the records, not a copy
        assert kept.dense_panels.shape == (192 // 16, 576, 16) and dense_min_rows(kept) == DENSE_MIN_ROWS_PANELS
        with torch.no_grad():
            assert torch.equal(y, kept(big))  # records or copy: the same bits
        assert torch.equal(y, cpu_ops.f32_linear(big, pack_f32_panels(reference(weight))))
    else:
        assert not any(hasattr(layer, name) for name in DENSE_COPIES)
        assert torch.equal(y, cpu_ops.q4_linear(big, layer.q4_weight))
        assert kept.dense_packed.dtype == torch.float32 and dense_min_rows(kept) == DENSE_MIN_ROWS_FLOAT32


def test_q8_0_parts_keep_the_two_plane_int4_form(cpu_ops: CpuOps) -> None:
    """A fused layer with a Q8_0 part has no Q4 form; it stays on torch's int4 planes."""
    layer = QKVParallelLinear(128, 32, total_num_heads=2, total_num_kv_heads=1)
    parts = {"q": gguf_weight(torch.randn(64, 128), "Q4_1"), "k": gguf_weight(torch.randn(32, 128), "Q8_0"),
             "v": gguf_weight(torch.randn(32, 128), "Q4_0")}  # fmt: skip
    gguf_layer(layer, parts, cpu_ops)
    assert linear_form(layer) == "int4x2"


def test_the_q8_lm_head_in_vnni_records_is_the_fixed_point_product_with_its_exact_blocks(cpu_ops: CpuOps) -> None:
    """The LM head (a GGUF's Q8_0 token embedding, runtime/layers/quantization/q8.py) through
    the same kernel: codes q + 128 with m = -128 d, so the records hold the weight exactly."""
    torch.manual_seed(3)
    n, k = 64, 576
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    q[:, ::32] = 127  # each block's largest |value| is 127 d: the blocks are exact Q8
    w = (q.float().view(n, k // 32, 32) * (torch.rand(n, k // 32) * 0.01).half().float()[..., None]).view(n, k)
    packed = pack_q8_exact(w)
    assert packed is not None
    records = pack_q8_vnni(packed)
    assert records.shape == (n // 16, k // 32, 576)
    x = torch.randn(9, k)
    x[:, 7] *= 40
    y = cpu_ops.q8_linear_vnni(x, records)
    ref = fixed_point(x) @ w.double().T
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert ((y.double() - x.double() @ w.double().T).abs().max() / ref.abs().max()).item() < 3e-4
    assert torch.equal(cpu_ops.q8_linear_vnni(x[4:5].clone(), records)[0], y[4])  # per row: batch-invariant


def test_the_panels_take_batches_from_the_fewest_rows_that_win_from_there_on() -> None:
    """q4q8.crossover_rows, over what measure_panels_min_rows times: (rows, blocks, panels)."""
    assert q4q8.crossover_rows([(2, 1.0, 3.0), (4, 2.0, 2.5), (6, 3.0, 2.9), (8, 4.0, 3.1)], never=256) == 6
    # A win below a loss does not count: the panels must win at every larger count timed.
    assert q4q8.crossover_rows([(2, 1.0, 0.9), (4, 2.0, 2.5), (6, 3.0, 2.9)], never=256) == 6
    assert q4q8.crossover_rows([(2, 1.0, 0.5), (4, 2.0, 1.0)], never=256) == 2
    assert q4q8.crossover_rows([(2, 1.0, 0.5), (4, 2.0, 2.1)], never=256) == 256
    assert q4q8.crossover_rows([(2, 1.0, 1.02), (4, 2.0, 1.5)], never=256) == 2  # within TIE: the copy's


def test_the_crossover_is_measured_once_a_model_shape_on_its_own_layers(
    cpu_ops: CpuOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each load settles its layers' crossover: measured on its own weights the first time
    a model of those shapes loads in the process, reused by the next load of the same
    shapes, measured again for a differently shaped model (its row count, not the first's)."""
    if native_bf16_matmul(torch.device("cpu")) or not cpu_ops.q4_linear_isa() or not cpu_ops.f32_linear_isa():
        pytest.skip("float32 panels are kept only beside Q4 blocks on AVX2 CPUs without native bf16")

    def model_of(n: int, k: int) -> torch.nn.Module:
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(
            gguf_layer(ColumnParallelLinear(k, n), {None: gguf_weight(torch.randn(n, k) * 0.02, "Q4_1")}, cpu_ops)
            for _ in range(2)
        )
        return model

    model = model_of(192, 576)
    monkeypatch.setattr(q4q8, "measured_crossovers", {})
    timed: list[tuple[int, ...]] = []
    measure = q4q8.measure_panels_min_rows

    def counted(layers: Any, ops: CpuOps, repeats: int = 2) -> int:
        timed.append(tuple(layer.output_size_per_partition for layer in layers))
        return measure(layers, ops, repeats)

    monkeypatch.setattr(q4q8, "measure_panels_min_rows", counted)
    assert all(dense_min_rows(layer) == DENSE_MIN_ROWS_PANELS for layer in model.layers)  # until settled
    rows = settle_dense_min_rows(model, cpu_ops)
    assert timed == [(192, 192)] and rows in (*q4q8.PANELS_TIMED_ROWS, 2 * q4q8.PANELS_TIMED_ROWS[-1])
    assert all(dense_min_rows(layer) == rows for layer in model.layers)
    again = model_of(192, 576)
    assert settle_dense_min_rows(again, cpu_ops) == rows and timed == [(192, 192)]  # reused, not re-measured
    assert all(dense_min_rows(layer) == rows for layer in again.layers)
    # A differently shaped model: its own measurement, whatever it finds; the first keeps its rows.
    monkeypatch.setattr(q4q8, "measure_panels_min_rows", lambda layers, ops, repeats=2: timed.append((0,)) or 7)
    other = model_of(64, 256)
    assert settle_dense_min_rows(other, cpu_ops) == 7 and timed[-1] == (0,)
    assert all(dense_min_rows(layer) == 7 for layer in other.layers)
    assert all(dense_min_rows(layer) == rows for layer in model.layers)
    # From there on the layer takes the panels: the float32 product, not the blocks'.
    x = torch.randn(rows, 576)
    with torch.no_grad():
        y = model.layers[0](x)
    if rows <= q4q8.PANELS_TIMED_ROWS[-1]:
        assert torch.equal(y, cpu_ops.f32_linear(x, model.layers[0].dense_panels))
