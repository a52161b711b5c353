"""Linear layers over the packed token layout `[T, in]`, split over tensor-parallel ranks.

Megatron's pairing: a column-parallel layer (QKV, gate|up) splits its output rows, so
each rank computes its heads / its slice of the intermediate with no communication;
the row-parallel layer after it (O, down) splits its input columns to match and
all-reduces its output, once per layer pair. At tp_size 1 every split is the whole.

Parameters are created with `torch.empty` (no init pass): models are built directly
on the target device in the target dtype, then filled through each parameter's
`weight_loader` (runtime/layers/weights.py). The weights' layout and matmul belong to
the layer's `quant_method` (vLLM's and SGLang's seam): `UnquantizedLinearMethod` is
the HF layout `[out, in]`; the weight-only methods in runtime/layers/quantization/
load that same float weight, then `process_weights_after_loading` packs it (except
gguf's, whose `load_weight` keeps the checkpoint's own blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed.parallel_state import divide, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from runtime.layers.batch_invariant import in_fixed_row_blocks
from runtime.layers.weights import LazyWeight, ShardId, copy_into, set_weight_attrs


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds (and its KV pool stores): the heads split over ranks, or
    one head replicated on `tp_size // total_num_kv_heads` ranks when there are fewer
    heads than ranks (vLLM's and SGLang's rule)."""
    if tp_size % total_num_kv_heads and total_num_kv_heads % tp_size:
        raise ValueError(
            f"tp_size={tp_size} must divide num_key_value_heads={total_num_kv_heads} or be a multiple of it"
        )
    return max(1, total_num_kv_heads // tp_size)


class LinearMethod(Protocol):
    # True when the kernel computes each output row by itself, in an order that does not
    # depend on M (runtime/layers/batch_invariant.py): then it needs no fixed row blocks.
    row_invariant: ClassVar[bool]

    def create_weights(self, layer: LinearBase, input_size_per_partition: int, output_size_per_partition: int) -> None:
        """Register the layer's weight parameter(s)."""

    def load_weight(self, layer: LinearBase, loaded_weight: LazyWeight, dst_offset: int) -> None:
        """Take this rank's rows of one checkpoint tensor (already narrowed), which go to
        output rows `[dst_offset, dst_offset + rows)` of the layer's weight."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Convert the loaded weights to the layout `apply` reads (once, after loading)."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    """`weight: [out_per_partition, in_per_partition]` in the model dtype; `y = x @ weight.T + bias`."""

    row_invariant: ClassVar[bool] = False  # BLAS/oneDNN choose their kernel by M

    def create_weights(self, layer: LinearBase, input_size_per_partition: int, output_size_per_partition: int) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size_per_partition, input_size_per_partition), requires_grad=False)

    def load_weight(self, layer: LinearBase, loaded_weight: LazyWeight, dst_offset: int) -> None:
        copy_into(layer.weight.data.narrow(0, dst_offset, loaded_weight.shape[0]), loaded_weight)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        pass  # the checkpoint layout is the compute layout

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class F32PanelsLinearMethod(UnquantizedLinearMethod):
    """A float32 weight as the CPU kernels' f32_linear panels (`layer.f32_panels`,
    `[out / 16, in, 16]`; runtime.models.cpu_path.use_f32_panels puts it there on CPUs
    where f32_linear has its AVX2 form). F.linear on a plain float32 weight re-packs it
    on every call: SmolLM2's 120 linears on a Zen 1 EPYC took 42 / 107 / 167 ms at 1 / 4 /
    16 rows that way, 20 / 25 / 54 ms on the panels (bench/RESULTS.md item 30). One
    ordered fma chain per output: a row's bits never depend on M."""

    row_invariant: ClassVar[bool] = True

    def __init__(self, ops: F32Kernels) -> None:
        self.ops = ops

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.ops.f32_linear(x.reshape(-1, x.shape[-1]), layer.f32_panels)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y if bias is None else y + bias

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The float32 weight `[out, in]` (the panels hold it exactly)."""
        panels = layer.f32_panels
        return panels.transpose(1, 2).reshape(-1, panels.shape[1])


class OneDnnPackedLinearMethod(UnquantizedLinearMethod):
    """A float32 weight in oneDNN's blocked layout for `DENSE_PACK_ROWS`-row batches
    (`layer.onednn_packed`; runtime.models.cpu_path.use_onednn_packed puts it there where
    f32_linear's panels are not built: AVX-512 CPUs, whose oneDNN has the 512-bit form).
    F.linear on the plain weight goes through another GEMM (MKL's sgemm): SmolLM2's four
    linear shapes of a layer on a Zen 4 took 0.31-0.44 / 1.10-1.40 / 13.3-13.9 ms at 1 / 16 /
    256 rows that way, 0.21-0.31 / 0.67-0.68 / 9.5-10.4 packed, the same as the panels
    (bench/RESULTS.md item 37). oneDNN picks its kernel by M: not row-invariant."""

    row_invariant: ClassVar[bool] = False

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, layer.onednn_packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The float32 weight `[out, in]`, exactly: the layer applied to the identity (each
        output one product by 1.0 plus zeros)."""
        eye = torch.eye(layer.input_size_per_partition)
        return torch.ops.mkldnn._linear_pointwise(eye, layer.onednn_packed, None, "none", [], "").T.contiguous()


class F32Kernels(Protocol):  # kernels/cpu's CpuOps, the part F32PanelsLinearMethod calls
    def f32_linear(self, x: torch.Tensor, panels: torch.Tensor) -> torch.Tensor: ...


class OutputShard(NamedTuple):
    """One checkpoint projection stacked in a layer's output rows (q, k, v; gate, up)."""

    shard_id: ShardId
    full_size: int  # rows of the checkpoint tensor
    size: int  # rows this rank holds
    src_start: int  # first checkpoint row this rank holds
    dst_offset: int  # where they go in this rank's output rows


class LinearBase(nn.Module):
    """Output rows are `output_shards` stacked in order; `weight_loader` fills one shard
    (dim 0 narrowed to this rank's rows). The input dim is whole unless a subclass splits it."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        input_size: int,
        input_size_per_partition: int,
        output_shards: Sequence[OutputShard],
        bias: bool,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.input_size_per_partition = input_size_per_partition
        self.output_shards = {s.shard_id: s for s in output_shards}
        self.output_size_per_partition = sum(s.size for s in output_shards)
        self.quant_method: LinearMethod = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, input_size_per_partition, self.output_size_per_partition)
        self.bias = nn.Parameter(torch.empty(self.output_size_per_partition), requires_grad=False) if bias else None
        self.batch_invariant = False  # deterministic inference: rows independent of the batch
        for param in self.parameters(recurse=False):
            shapes = {s.shard_id: (s.full_size, input_size)[: param.dim()] for s in output_shards}
            set_weight_attrs(param, self.weight_loader, shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.batch_invariant and not self.quant_method.row_invariant:
            return in_fixed_row_blocks(lambda rows: self.quant_method.apply(self, rows, bias), x)
        return self.quant_method.apply(self, x, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LazyWeight, shard_id: ShardId = None) -> None:
        if shard_id not in self.output_shards:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r} (has {list(self.output_shards)})")
        shard = self.output_shards[shard_id]
        rows = loaded_weight.narrow(0, shard.src_start, shard.size)
        if param is self.weight:  # its layout is the quant method's
            self.quant_method.load_weight(self, rows, shard.dst_offset)
        else:
            copy_into(param.data.narrow(0, shard.dst_offset, shard.size), rows)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_partition}, out={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, tp_size={self.tp_size}"
        )


def _split_shards(output_sizes: Sequence[int], shard_ids: Sequence[ShardId], tp_rank: int, tp_size: int) -> list[OutputShard]:
    """Each projection split evenly over ranks; rank r holds rows [r * size, (r + 1) * size)."""
    shards, offset = [], 0
    for shard_id, full in zip(shard_ids, output_sizes, strict=True):
        size = divide(full, tp_size)
        shards.append(OutputShard(shard_id, full, size, tp_rank * size, offset))
        offset += size
    return shards


class ColumnParallelLinear(LinearBase):
    """Output rows split over ranks; each rank's output is its slice (not gathered)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, input_size, _split_shards([output_size], [None], get_tp_rank(), get_tp_size()), bias)


class MergedColumnParallelLinear(LinearBase):
    """Several projections of one input (gate|up) stacked, each split over ranks: rank
    r's output is `[gate_r | up_r]`, so one matmul replaces several and the activation
    pairs gate and up rows locally. Checkpoint tensor i loads as shard i."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        shards = _split_shards(output_sizes, range(len(output_sizes)), get_tp_rank(), get_tp_size())
        super().__init__(input_size, input_size, shards, bias)
        self.output_sizes = tuple(output_sizes)


class QKVParallelLinear(LinearBase):
    """q|k|v projections stacked; rank r holds q heads `[r * hq, (r + 1) * hq)` and either
    its share of the kv heads or, when tp_size > total_num_kv_heads, kv head
    `r // num_kv_head_replicas` (each kv head replicated on that many consecutive ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False) -> None:
        tp_rank, tp_size = get_tp_rank(), get_tp_size()
        if total_num_heads % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide num_attention_heads={total_num_heads}")
        num_heads, num_kv_heads = total_num_heads // tp_size, kv_heads_per_rank(total_num_kv_heads, tp_size)
        num_kv_head_replicas = max(1, tp_size // total_num_kv_heads)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        kv_start = tp_rank // num_kv_head_replicas * kv
        shards = [
            OutputShard("q", total_num_heads * head_dim, q, tp_rank * q, 0),
            OutputShard("k", total_num_kv_heads * head_dim, kv, kv_start, q),
            OutputShard("v", total_num_kv_heads * head_dim, kv, kv_start, q + kv),
        ]
        super().__init__(hidden_size, hidden_size, shards, bias)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_kv_head_replicas = num_kv_head_replicas


class RowParallelLinear(LinearBase):
    """Input columns split over ranks (the input is the column-parallel layer's output
    slice); the partial products are all-reduced, then the whole bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        shards = [OutputShard(None, output_size, output_size, 0, 0)]
        super().__init__(input_size, divide(input_size, tp_size), shards, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LazyWeight, shard_id: ShardId = None) -> None:
        if param is self.weight:  # the bias is not split: every rank holds all of it
            per = self.input_size_per_partition
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * per, per)
        super().weight_loader(param, loaded_weight, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        out = tensor_model_parallel_all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias
