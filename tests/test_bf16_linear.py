"""The dense path of the quantized linears (kernels/cpu/bf16_linear.cpp): bfloat16
operands, float32 sums and output, as prefill and batches of DENSE_MIN_ROWS or more run,
on each ISA this CPU offers: AMX tiles and AVX512-BF16 vectors (the path of CPUs without
AMX; an AMX CPU has both, so it tests both).

What it computes is fixed exactly: x and W each rounded to bfloat16 (round to nearest
even), their products summed in float32. Against that reference in float64 the kernel
differs only by float32 accumulation; unlike torch's bf16 linear, the output is never
rounded to bfloat16 (that rounding cost SmolLM2 0.3 points of top-1 agreement).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import CpuOps, PinnedIsa
from runtime.layers.quantization.int4 import pack_bf16_tiles


@pytest.fixture(params=["amx-bf16", "avx512-bf16"])
def isa_ops(cpu_ops: CpuOps, request: pytest.FixtureRequest) -> PinnedIsa:
    if request.param not in cpu_ops.bf16_linear_isas():
        pytest.skip(f"this CPU has no {request.param.upper()} (with neither, the engine keeps oneDNN's bf16 copy)")
    return PinnedIsa(cpu_ops, request.param)


def bf16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().double() @ w.bfloat16().double().T


# M covers the tails of 16- and 32-row tiles and, at K = 1536, more than one chunk of rows
# (kChunkBytes); N = 48 and 592 end on a lone 16-output block.
@pytest.mark.parametrize("M", [1, 15, 16, 17, 33, 300])
@pytest.mark.parametrize("N,K", [(16, 32), (48, 576), (592, 1536), (960, 576)])
def test_the_product_of_the_bf16_operands_summed_in_float32(isa_ops: PinnedIsa, M: int, N: int, K: int) -> None:
    torch.manual_seed(M * 7 + N)
    x, w = torch.randn(M, K), torch.randn(N, K) * 0.05
    y = isa_ops.bf16_linear(x, pack_bf16_tiles(w.bfloat16()))
    assert y.dtype == torch.float32 and y.shape == (M, N) and y.is_contiguous()
    ref = bf16_product(x, w)
    # float32 sums of K products: a few ulps of the sum of magnitudes.
    bound = 1e-6 * (x.bfloat16().double().abs() @ w.bfloat16().double().abs().T) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()
    # Not the float32 product: the operands really are rounded (a test that could not fail otherwise).
    assert not torch.allclose(y.double(), x.double() @ w.double().T, rtol=1e-6, atol=0)


def test_bfloat16_input_is_used_as_is_and_gives_the_float_inputs_result(isa_ops: PinnedIsa) -> None:
    x, w = torch.randn(40, 576), torch.randn(64, 576)
    tiles = pack_bf16_tiles(w.bfloat16())
    assert torch.equal(isa_ops.bf16_linear(x.bfloat16(), tiles), isa_ops.bf16_linear(x, tiles))


def test_a_row_gets_the_same_bits_alone_and_in_any_batch(isa_ops: PinnedIsa) -> None:
    x, tiles = torch.randn(70, 576), pack_bf16_tiles(torch.randn(96, 576).bfloat16())
    full = isa_ops.bf16_linear(x, tiles)
    for rows in (slice(0, 1), slice(3, 20), slice(33, 70)):
        assert torch.equal(isa_ops.bf16_linear(x[rows].clone(), tiles), full[rows])


def test_the_tile_layout_puts_each_weight_where_the_kernel_reads_it() -> None:
    w = torch.arange(32 * 64, dtype=torch.float32).view(32, 64).bfloat16()  # exact in bf16
    t = pack_bf16_tiles(w)
    assert t.shape == (2, 2, 16, 16, 2)
    for n, k, p, j, e in [(0, 0, 0, 0, 0), (1, 0, 3, 5, 1), (0, 1, 15, 15, 0), (1, 1, 7, 2, 1)]:
        assert t[n, k, p, j, e] == w[16 * n + j, 32 * k + 2 * p + e]


def test_mismatched_shapes_are_refused(isa_ops: PinnedIsa) -> None:
    tiles = pack_bf16_tiles(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="K"):
        isa_ops.bf16_linear(torch.randn(4, 96), tiles)
    with pytest.raises(RuntimeError, match="packed"):
        isa_ops.bf16_linear(torch.randn(4, 64), torch.randn(32, 64).bfloat16())


# I = 16 is one gate and one up block; 48 and 1536 (SmolLM2) several; M as above.
@pytest.mark.parametrize("M", [1, 17, 33, 300])
@pytest.mark.parametrize("I,K", [(16, 32), (48, 576), (1536, 576)])
def test_the_fused_gate_up_activation_has_the_bits_of_silu_mul_over_the_linear(
    isa_ops: PinnedIsa, M: int, I: int, K: int
) -> None:
    torch.manual_seed(M + I)
    x, tiles = torch.randn(M, K), pack_bf16_tiles((torch.randn(2 * I, K) * 0.1).bfloat16())
    fused = isa_ops.bf16_linear_silu_mul(x, tiles)
    assert fused.shape == (M, I) and fused.dtype == torch.float32
    assert torch.equal(fused, isa_ops.silu_mul(isa_ops.bf16_linear(x, tiles)))


def test_the_default_isa_is_the_first_offered_and_an_unknown_one_is_refused(cpu_ops: CpuOps) -> None:
    isas = cpu_ops.bf16_linear_isas()
    if not isas:
        pytest.skip("this CPU has neither AMX-BF16 nor AVX512-BF16")
    x, tiles = torch.randn(20, 64), pack_bf16_tiles(torch.randn(48, 64).bfloat16())
    assert torch.equal(cpu_ops.bf16_linear(x, tiles), cpu_ops.bf16_linear(x, tiles, isas[0]))
    with pytest.raises(RuntimeError, match="isa"):
        cpu_ops.bf16_linear(x, tiles, "sse2")
