"""`--quantization gguf`: linear layers keep a GGUF file's own Q4_0/Q4_1/Q8_0 blocks.

Each `LinearBase` gets its own `GgufLinearMethod`, a loader: its `weight` is a
meta-device placeholder (the checkpoint name and shape, no storage), and each
checkpoint tensor's rows that reach it (q, k, v; gate, up; this rank's part) are kept
as `GgufWeight`s, unread. After loading it decodes them straight into torch's int4
layout (gguf_blocks.py) and hands the layer to the method that computes with it:

    all parts Q4_0/Q4_1          -> Q4Q8LinearMethod where the CPU kernels are bound and
                                    the CPU has AVX512-VNNI or AVX2 (the file's blocks as they
                                    are, 16-bit fixed-point activations: q4q8.py), else
                                    Int4LinearMethod, group 32 (one plane)
    any part Q8_0, rest Q4/Q8    -> Int4PlanesLinearMethod, two planes (Q4 parts' second
                                    plane is zero), exact where per-channel int8 is not
    any other part (F16, Q6_K..),
    or a shape the kernel refuses -> UnquantizedLinearMethod, gguf's float dequantization

so a layer is packed whole or float whole, and the float matrix of a packed one is
never built. A packed layer also keeps a dense copy of its weight (`keep_dense_copy`), which
big batches (prefill, large decode batches) run through instead: the packed kernels are
fastest at a few rows and grow linearly with them (int4.dense_matmul: from 24 rows;
q4q8.dense_min_rows: 32 for bfloat16, 128 for oneDNN's float32, measured at load for the
kernels' float32 panels). Its dtype is `dense_dtype`'s: bfloat16 where bfloat16 matmuls are
native (AMX / AVX512-BF16; +2 bytes a weight), else float32 (AVX2: its FMA units outrun the
Q4 kernel's integer products from ~6 rows on a Zen 1, ~48 on a Zen 2; +4 bytes a weight,
so only while the model's copies fit DENSE_FLOAT32_MAX_BYTES). Past that budget, where the
kernels have f32_linear's AVX2 form, a q4q8 layer's records stand in for the copy: f32_linear
reads them as its panels, dequantizing one at a time as it goes (`dense_panels` is then the
records themselves; the same bits as the copy, no memory, ~5% slower than the copy's panels
at 16 rows on a Zen 1, where the FMAs and not the bytes bound it; bench/RESULTS.md item 31).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from runtime.layers.linear import UnquantizedLinearMethod
from runtime.layers.quantization.gguf_blocks import BLOCK, GgufWeight, Int4Planes
from runtime.layers.quantization.q4q8 import Q4Q8LinearMethod, pack_q4
from runtime.layers.quantization.int4 import (
    ACT_DTYPE,
    N_MULTIPLE,
    Int4LinearMethod,
    dense_matmul,
    keep_dense_copy,
    pack_int4,
    unpack_int4,
)
from runtime.layers.weights import LazyWeight

if TYPE_CHECKING:
    from kernels.cpu import CpuOps
    from runtime.layers.linear import LinearBase


class Int4PlanesLinearMethod(Int4LinearMethod):
    """A weight that is the sum of `planes` int4 planes `[N, K]`, packed side by side as
    one int4 matrix `[N, planes * K]` (plane p is columns `[p * K, (p + 1) * K)`): the
    activation is repeated `planes` times along K, so one kernel call sums them."""

    def __init__(self, planes: int) -> None:
        super().__init__(BLOCK)
        self.planes = planes

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dense = dense_matmul(layer, x, bias)
        if dense is not None:
            return dense
        x2 = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE).repeat(1, self.planes)
        packed, scales_and_zeros = cast(torch.Tensor, layer.packed), cast(torch.Tensor, layer.scales_and_zeros)
        out = torch._weight_int4pack_mm_for_cpu(x2, packed, BLOCK, scales_and_zeros).to(x.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        packed, scales_and_zeros = cast(torch.Tensor, layer.packed), cast(torch.Tensor, layer.scales_and_zeros)
        n, k = packed.shape[0], packed.shape[1] * 2 // self.planes
        sz = scales_and_zeros.float().view(self.planes, k // BLOCK, n, 2).permute(0, 2, 1, 3)
        planes = Int4Planes(unpack_int4(packed, BLOCK).view(n, self.planes, k).transpose(0, 1), sz[..., 0], sz[..., 1])
        return planes.dequantize()


def pack_planes(planes: Int4Planes) -> tuple[torch.Tensor, torch.Tensor]:
    """`Int4Planes [P, N, K]` -> (torch's packed uint8 `[N, P * K / 2]`, scales_and_zeros
    `[P * K / BLOCK, N, 2]` in ACT_DTYPE): plane p's group g is group `p * K / BLOCK + g`."""
    p, n, k = planes.q.shape
    codes = planes.q.permute(1, 0, 2).reshape(n, p * k).to(torch.int32)
    sz = torch.stack([planes.scale, planes.zero], dim=-1)  # [P, N, G, 2]
    return pack_int4(codes), sz.permute(0, 2, 1, 3).reshape(p * k // BLOCK, n, 2).to(ACT_DTYPE).contiguous()


def native_bf16_matmul(device: torch.device) -> bool:
    """oneDNN runs bfloat16 GEMMs in hardware here (AMX or AVX512-BF16)."""
    return device.type == "cpu" and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


# The most bytes of float32 dense copies a model keeps (SmolLM2's 120 linears: 425 MB); a
# bigger model runs prefill on its packed kernels rather than hold 8x its Q4 bytes again.
DENSE_FLOAT32_MAX_BYTES = 1 << 30


def dense_dtype(device: torch.device, weights: int) -> torch.dtype | None:
    """The dtype of the dense copies of a model whose packable linears hold `weights`
    values, or None (none kept: the packed kernels take every batch)."""
    if native_bf16_matmul(device):
        return torch.bfloat16
    if device.type == "cpu" and torch.backends.mkldnn.is_available() and 4 * weights <= DENSE_FLOAT32_MAX_BYTES:
        return torch.float32
    return None


def dense_weight(planes: Int4Planes, dtype: torch.dtype) -> torch.Tensor:
    """The planes' weight `[N, K]` in `dtype`: bfloat16 from float32 sums (the float64 of
    `Int4Planes.dequantize` would change nothing after the bfloat16 rounding), float32
    from that float64 (each weight rounded once)."""
    if dtype != torch.bfloat16:
        return planes.dequantize().to(dtype)
    p, n, k = planes.q.shape
    groups = (planes.q.float().view(p, n, k // BLOCK, BLOCK) - 8) * planes.scale[..., None] + planes.zero[..., None]
    return groups.sum(0).view(n, k).to(torch.bfloat16)


def _with_planes(planes: Int4Planes, count: int) -> Int4Planes:
    """Pad with planes that add nothing (q = 8, scale 0, zero 0)."""
    extra = count - planes.q.shape[0]
    if extra == 0:
        return planes
    _, n, k = planes.q.shape
    q = torch.cat([planes.q, torch.full((extra, n, k), 8, dtype=torch.uint8)])
    pad = torch.zeros(extra, n, k // BLOCK)
    return Int4Planes(q, torch.cat([planes.scale, pad]), torch.cat([planes.zero, pad]))


class GgufLinearMethod(UnquantizedLinearMethod):
    """The loader of one layer (see the module docstring). `dtype` and `device` are the
    model's: a float fallback weight is built in them. `ops`: the CPU kernels, when
    bound (their q4_linear takes Q4 layers on a VNNI or AVX2 CPU). `dense`: the dtype of
    the dense copy a packed layer keeps (`dense_dtype`), or None."""

    def __init__(
        self, dtype: torch.dtype, device: torch.device, ops: CpuOps | None = None, dense: torch.dtype | None = None
    ) -> None:
        self.dtype, self.device, self.dense = dtype, device, dense
        self.q4_ops = ops if ops is not None and ops.q4_linear_isa() and device.type == "cpu" else None
        self.parts: list[tuple[int, LazyWeight | torch.Tensor]] = []  # (first output row, rows)

    def create_weights(self, layer: LinearBase, input_size_per_partition: int, output_size_per_partition: int) -> None:
        placeholder = torch.empty(output_size_per_partition, input_size_per_partition, dtype=self.dtype, device="meta")
        layer.weight = nn.Parameter(placeholder, requires_grad=False)

    def load_weight(self, layer: LinearBase, loaded_weight: LazyWeight, dst_offset: int) -> None:
        if tuple(layer.weight.shape[1:]) != loaded_weight.shape[1:]:
            raise ValueError(f"checkpoint slice {loaded_weight.shape} != parameter rows of {tuple(layer.weight.shape)}")
        # A GgufWeight stays readable (the reader's memory map); any other source (a
        # safetensors slice) only while its file is open: read it now.
        self.parts.append((dst_offset, loaded_weight if isinstance(loaded_weight, GgufWeight) else loaded_weight.materialize()))

    def packable(self, layer: LinearBase) -> bool:
        n, k = layer.weight.shape
        return (
            n % N_MULTIPLE == 0
            and k % BLOCK == 0
            and all(isinstance(w, GgufWeight) and w.packable for _, w in self.parts)
        )

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Pack (or dequantize) the parts; `layer.quant_method` becomes the method that
        computes with them (quantization.linear_form names it)."""
        n, k = layer.weight.shape
        if sum(w.shape[0] for _, w in self.parts) != n:
            raise ValueError(f"gguf: {n} output rows expected, {sum(w.shape[0] for _, w in self.parts)} loaded")
        packable, parts = self.packable(layer), sorted(self.parts, key=lambda part: part[0])
        self.parts = []
        method: UnquantizedLinearMethod
        if packable:
            decoded = [cast(GgufWeight, w).int4_planes() for _, w in parts]
            count = max(p.q.shape[0] for p in decoded)
            decoded = [_with_planes(p, count) for p in decoded]
            planes = Int4Planes(*(torch.cat(fields, dim=1) for fields in zip(*decoded)))
            del layer.weight  # the placeholder goes: the packed tensors replace it
            if count == 1 and self.q4_ops is not None:
                # Q4_1: zero = m + 8d was summed in float32 from fp16 d and m; undoing it
                # gives m back exactly (the loader test compares with gguf's values bit for bit).
                scale, zero = planes.scale[0], planes.zero[0]
                records = pack_q4(planes.q[0], scale.half(), (zero - 8 * scale).half())
                layer.q4_weight = nn.Parameter(records.to(self.device), requires_grad=False)
                method = Q4Q8LinearMethod(self.q4_ops)
                if self.dense is None and self.q4_ops.f32_linear_isa():
                    # AVX2, past the float32 copies' budget: big batches run f32_linear on the
                    # records themselves, each panel dequantized as it comes (the file's
                    # weights in float32, bit for bit; no copy).
                    layer.register_buffer("dense_panels", layer.q4_weight.data, persistent=False)
            else:
                packed, scales_and_zeros = pack_planes(planes)
                layer.packed = nn.Parameter(packed.to(self.device), requires_grad=False)
                layer.scales_and_zeros = nn.Parameter(scales_and_zeros.to(self.device), requires_grad=False)
                method = Int4LinearMethod(BLOCK) if count == 1 else Int4PlanesLinearMethod(count)
            if self.dense is not None:  # prefill and big batches: see int4.dense_matmul
                # the kernels' tiles only for a method that runs them (q4q8 holds the kernels)
                ops = self.q4_ops if isinstance(method, Q4Q8LinearMethod) else None
                keep_dense_copy(layer, dense_weight(planes, self.dense).to(self.device), ops)
        else:
            weight = torch.empty(n, k, dtype=self.dtype, device=self.device)
            for offset, w in parts:
                rows = w.materialize() if isinstance(w, LazyWeight) else w
                weight[offset : offset + rows.shape[0]].copy_(rows)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            method = UnquantizedLinearMethod()
        layer.quant_method = method
