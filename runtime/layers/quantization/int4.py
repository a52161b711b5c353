"""int4 weight-only linear: asymmetric, one (scale, zero) per group of input columns.

Group g of row n covers columns `[g * G, (g + 1) * G)`; with `q` in [0, 15],
`w ~= (q - 8) * scale + zero` (tinygemm's convention, which torch's CPU kernel
`_weight_int4pack_mm_for_cpu` follows): `zero = min + 8 * scale`, so the group's min
and max land exactly on q = 0 and q = 15. `packed` is torch's CPU int4 layout (uint8
`[N, K / 2]`, blocked for its kernel: read it back only through `unpack_int4`).
The kernel needs K % G == 0 and N % 16 == 0; other shapes are refused at load. Its
float32 activation path is many times slower than bfloat16, so activations are cast
to bfloat16 in and the output back to the input dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, NamedTuple, cast

import torch
from torch import nn

from runtime.layers.batch_invariant import prompt_rows
from runtime.layers.linear import UnquantizedLinearMethod

if TYPE_CHECKING:
    from kernels.cpu import CpuOps
    from runtime.layers.linear import LinearBase

ACT_DTYPE = (
    torch.bfloat16
)  # the kernel's fast activation dtype; scales and zeros are stored in it too
# 32 = llama.cpp's Q4_0/Q4_1 block; the SmolLM2 hidden size 576 is not a multiple of 64 * 2.
DEFAULT_GROUP_SIZE = 32
N_MULTIPLE = 16  # the CPU packing's output-row block


class Int4Weight(NamedTuple):
    packed: torch.Tensor  # uint8 [N, K / 2], torch's CPU int4 layout
    scales_and_zeros: (
        torch.Tensor
    )  # [K / G, N, 2] in ACT_DTYPE: (scale, zero) per group and row


def check_int4_shape(n: int, k: int, group_size: int) -> None:
    if k % group_size or n % N_MULTIPLE:
        raise ValueError(
            f"int4 needs in_features % {group_size} == 0 and out_features % {N_MULTIPLE} == 0 "
            f"(per tensor-parallel rank); got out={n}, in={k}: use --quantization int8 or none"
        )


def quantize_int4_values(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` -> (`q` int32 [N, K] in [0, 15], `scales_and_zeros` [K / G, N, 2]).
    Scale and zero are rounded to ACT_DTYPE before `q` is computed, so `q` is the best
    grid point for the values the kernel actually reads."""
    n, k = w.shape
    check_int4_shape(n, k, group_size)
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(ACT_DTYPE).float()
    zero = (lo + 8 * scale).to(ACT_DTYPE).float()
    q = (
        torch.round((groups - zero[..., None]) / scale[..., None] + 8)
        .clamp(0, 15)
        .to(torch.int32)
    )
    scales_and_zeros = (
        torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(ACT_DTYPE)
    )
    return q.view(n, k), scales_and_zeros


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int32 `[N, K]` in [0, 15] -> torch's CPU packed uint8 `[N, K / 2]`."""
    return torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """The int32 `[N, K]` values `packed` holds. The layout is the kernel's private
    business, so they are read back through the kernel itself: float32 identity
    activations with scale 1 and zero 8 give `(q - 8) * 1 + 8 = q` exactly."""
    n, k = packed.shape[0], packed.shape[1] * 2
    ones_eights = torch.tensor([1.0, 8.0]).expand(k // group_size, n, 2).contiguous()
    eye = torch.eye(k, device=packed.device)
    return (
        torch._weight_int4pack_mm_for_cpu(eye, packed, group_size, ones_eights)
        .T.round()
        .to(torch.int32)
    )


def dequantize_int4_values(
    q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """float32 `[N, K]`: `(q - 8) * scale + zero` per group."""
    n, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, K / G, 2]
    groups = (q.float().view(n, k // group_size, group_size) - 8) * sz[..., 0:1] + sz[
        ..., 1:2
    ]
    return groups.view(n, k)


# From this many rows on, a bfloat16 GEMM (oneDNN; AMX or AVX512-BF16) beats the int4
# kernel, whose time grows linearly with M while the GEMM reads 4x the weight bytes:
# SmolLM2's whole decode step (2 threads, bench/RESULTS.md item 15) took 62 ms int4 vs
# 68-71 ms bf16 at 16 rows and 113-118 vs 99 ms at 32; a prefill of 128 tokens 2x faster.
DENSE_MIN_ROWS = 24
# The batch size oneDNN lays the packed copy out for (keep_dense_copy).
DENSE_PACK_ROWS = 256


def pack_bf16_tiles(dense: torch.Tensor) -> torch.Tensor:
    """bfloat16 `[N, K]` -> the CPU kernels' bf16_linear layout `[N / 16, K / 32, 16, 16, 2]`
    (kernels/cpu/bf16_linear.cpp): element (n, k, p, j, e) is `dense[16 n + j, 32 k + 2 p + e]`."""
    n, k = dense.shape
    return dense.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def pack_f32_panels(dense: torch.Tensor) -> torch.Tensor:
    """float32 `[N, K]` -> the CPU kernels' f32_linear layout `[N / 16, K, 16]`
    (kernels/cpu/f32_linear.cpp): element (p, k, j) is `dense[16 p + j, k]`."""
    n, k = dense.shape
    return dense.view(n // 16, 16, k).transpose(1, 2).contiguous()


def keep_dense_copy(layer: nn.Module, dense: torch.Tensor, ops: CpuOps | None = None) -> None:
    """Give `layer` the dense copy `dense_matmul` uses (`[out, in]`, bfloat16 or float32:
    gguf.dense_dtype). A bfloat16 copy with the CPU kernels (`ops`) on a CPU with AMX-BF16 or
    AVX512-BF16 is kept as their bf16_linear's tiles (`dense_tiles`): float32 out, no casts
    around it; a float32 one, where the kernels' f32_linear has its AVX2 form, as its panels
    (`dense_panels`: on SmolLM2's GEMMs ~20% faster than oneDNN at 128-1024 rows on a Zen 2;
    level with it there on a Zen 1, 10-30% faster from 12 to 96 rows; bench/RESULTS.md
    item 28; past the budget a q4q8 layer's records take their place: gguf.GgufLinearMethod).
    Else, on the CPU, in oneDNN's blocked layout (`dense_packed`): F.linear on a plain weight
    re-packs that weight on every call.
    SmolLM2's 120 GEMMs at 64 / 256 / 1024 rows: plain 25-27 / 58-68 / 160-242 ms, packed
    for 256 rows 18.5 / 45 / 154 ms (the default hint's layout lost from 512 rows on;
    bench/RESULTS.md item 19)."""
    n, k = dense.shape
    if dense.dtype == torch.bfloat16 and ops is not None and ops.bf16_linear_isas() and n % 16 == 0 and k % 32 == 0:
        layer.register_buffer("dense_tiles", pack_bf16_tiles(dense), persistent=False)
    elif dense.dtype == torch.float32 and ops is not None and ops.f32_linear_isa() and dense.is_cpu and n % 16 == 0:
        layer.register_buffer("dense_panels", pack_f32_panels(dense), persistent=False)
    elif dense.is_cpu and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, DENSE_PACK_ROWS)
        layer.register_buffer("dense_packed", packed, persistent=False)
    else:
        layer.register_buffer("dense_weight", dense, persistent=False)


# The names a dense copy takes (keep_dense_copy), one per layer.
DENSE_COPIES = ("dense_tiles", "dense_panels", "dense_packed", "dense_weight")


def drop_dense_copy(layer: nn.Module) -> None:
    for name in DENSE_COPIES:
        if hasattr(layer, name):
            delattr(layer, name)


def has_invariant_copy(layer: nn.Module) -> bool:
    """Whether `layer`'s dense copy is one of the kernels' (bf16_linear's tiles, or what
    f32_linear reads as panels): a row's result is then the same whatever M (oneDNN's is not)."""
    return hasattr(layer, "dense_tiles") or hasattr(layer, "dense_panels")


def _takes_dense(layer: LinearBase, x: torch.Tensor, min_rows: int) -> bool:
    """The dense copy serves all of x: from `min_rows` rows on. Under deterministic
    inference a row's kernel must not depend on how many rows share the call: the copy
    serves x exactly when it is the kernels' (has_invariant_copy) and every row is a
    prompt token (batch_invariant.PromptRows; q4q8 splits a mixed x)."""
    if layer.batch_invariant:
        rows = prompt_rows()
        return has_invariant_copy(layer) and rows is not None and rows.dense is None
    return x.numel() >= min_rows * x.shape[-1]


def _on_rows(
    kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: torch.Tensor
) -> torch.Tensor:
    """A tile kernel over x's rows `[..., K]`: out `[..., width]` in x's dtype."""
    y = kernel(x.reshape(-1, x.shape[-1]), tiles)
    return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def dense_matmul(
    layer: LinearBase,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    min_rows: int = DENSE_MIN_ROWS,
    ops: CpuOps | None = None,
) -> torch.Tensor | None:
    """`x @ W.T (+ bias)` through the layer's dense copy of its quantized weight
    (`keep_dense_copy`; its dtype is gguf.dense_dtype's) when the batch has
    `min_rows` rows or more; None: use the packed kernel. Under deterministic inference,
    when every row is a prompt token and the copy is the kernels' (`_takes_dense`).
    `ops`: the CPU kernels, which run their copies and cast around oneDNN where bound."""
    if not _takes_dense(layer, x, min_rows):
        return None
    if has_invariant_copy(layer) and ops is not None:
        return invariant_matmul(layer, x, bias, ops)
    packed = cast(torch.Tensor | None, getattr(layer, "dense_packed", None))
    weight = packed if packed is not None else cast(torch.Tensor | None, getattr(layer, "dense_weight", None))
    if weight is None:
        return None
    to_dtype = ops.cast if ops is not None else torch.Tensor.to
    xb = to_dtype(x, weight.dtype)
    if packed is not None:
        y = torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], "")
    else:
        y = torch.nn.functional.linear(xb, weight)
    out = to_dtype(y, x.dtype)
    return out if bias is None else out + bias


def invariant_matmul(layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None, ops: CpuOps) -> torch.Tensor:
    """`x @ W.T (+ bias)` on the layer's bf16_linear tiles or f32_linear panels
    (`keep_dense_copy`, has_invariant_copy), whatever M."""
    tiles = cast(torch.Tensor | None, getattr(layer, "dense_tiles", None))
    if tiles is not None:
        y = _on_rows(ops.bf16_linear, x, tiles)
    else:
        y = _on_rows(ops.f32_linear, x.float(), cast(torch.Tensor, layer.dense_panels)).to(x.dtype)
    return y if bias is None else y + bias


def dense_silu_mul(layer: LinearBase, x: torch.Tensor, min_rows: int, ops: CpuOps) -> torch.Tensor | None:
    """`silu(gate) * up` of a gate|up layer in one call on its tiles (the bits of silu_mul
    over dense_matmul's output, without that [T, 2 I] output) exactly where dense_matmul
    would run them; else None."""
    tiles = cast(torch.Tensor | None, getattr(layer, "dense_tiles", None))
    if tiles is None or layer.bias is not None or not _takes_dense(layer, x, min_rows):
        return None
    return _on_rows(ops.bf16_linear_silu_mul, x, tiles)


class Int4LinearMethod(UnquantizedLinearMethod):
    """Loads the float weight as `UnquantizedLinearMethod` does; after loading, holds
    `packed` and `scales_and_zeros` (see `Int4Weight`) instead."""

    # torch's kernel accumulates each output row in its own K loop, the same code for
    # any M (its row tiles only share the dequantized weights): batch-invariant as is
    # (its dense copy, oneDNN's, is off under deterministic inference: _takes_dense).
    row_invariant: ClassVar[bool] = True

    def __init__(self, group_size: int = DEFAULT_GROUP_SIZE) -> None:
        if group_size not in (32, 64, 128, 256):  # the kernel's
            raise ValueError(
                f"int4 group_size must be 32, 64, 128 or 256, got {group_size}"
            )
        self.group_size = group_size

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        q, scales_and_zeros = quantize_int4_values(layer.weight.data, self.group_size)
        del layer.weight  # the float weight goes: the packed tensors replace it
        layer.packed = nn.Parameter(pack_int4(q), requires_grad=False)
        layer.scales_and_zeros = nn.Parameter(scales_and_zeros, requires_grad=False)

    def apply(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        dense = dense_matmul(layer, x, bias)
        if dense is not None:
            return dense
        # The kernel takes a 2-D activation with a contiguous last dim.
        x2 = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE).contiguous()
        packed, scales_and_zeros = (
            cast(torch.Tensor, layer.packed),
            cast(torch.Tensor, layer.scales_and_zeros),
        )
        out = torch._weight_int4pack_mm_for_cpu(
            x2, packed, self.group_size, scales_and_zeros
        ).to(x.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The float32 weight `[out, in]` the layer computes with."""
        packed, scales_and_zeros = (
            cast(torch.Tensor, layer.packed),
            cast(torch.Tensor, layer.scales_and_zeros),
        )
        return dequantize_int4_values(
            unpack_int4(packed, self.group_size), scales_and_zeros, self.group_size
        )
