"""Switches a built model onto the CPU fast path and the batch-invariant path.

`bind_cpu_ops` hands the compiled kernels (kernels/cpu) to every layer that has a
fused form: RMSNorm (+ residual), RoPE on the fused qkv, SiLU·mul, and the LM head
as exact Q8 blocks. Each such layer holds `ops = None` until then and runs its torch
code; with ops bound it runs the kernel, with the same numerics (math in float32,
the same roundings to the model dtype).

`FusedDecodeStack` then takes a decode batch's whole decoder stack into one C++ call
where every layer is on that path with Q4-block linears (the default CPU mode): the same
kernels in the same order, without the Python between them.

`make_batch_invariant` is `--enable-deterministic-inference` on the model side:
float matmuls run in fixed row blocks (runtime/layers/batch_invariant.py); the
attention side is the backend's (kernels/attention/torch_native.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import structlog
import torch
from torch import nn

from kernels.attention.base import AttentionBatch
from runtime.distributed.parallel_state import shm_group
from runtime.layers.activation import SiluAndMulMLP
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import (
    F32PanelsLinearMethod,
    LinearBase,
    LinearMethod,
    OneDnnPackedLinearMethod,
    UnquantizedLinearMethod,
)
from runtime.layers.logits_processor import LogitsProcessor
from runtime.layers.quantization import linear_layers
from runtime.layers.quantization.gguf import DENSE_FLOAT32_MAX_BYTES
from runtime.layers.quantization.int4 import DENSE_PACK_ROWS, pack_f32_panels
from runtime.layers.quantization.q4q8 import Q4Q8LinearMethod, crossover_for, dense_min_rows, time_crossover
from runtime.layers.quantization.q8 import pack_q8_exact, pack_q8_vnni
from runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from kernels.cpu import CpuOps

log = structlog.get_logger("sluice.cpu_path")


def bind_cpu_ops(model: nn.Module, ops: CpuOps) -> dict[str, int]:
    """Give `ops` to the layers that have a fused form; returns how many of each took it."""
    bound: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMulMLP, LlamaAttention)):
            module.ops = ops
            bound[type(module).__name__] = bound.get(type(module).__name__, 0) + 1
    if panels := use_f32_panels(model, ops):
        bound["f32_panels_linear"] = panels
    elif packed := use_onednn_packed(model):
        bound["onednn_packed_linear"] = packed
    if isinstance(model, LlamaForCausalLM):
        processor: LogitsProcessor = model.logits_processor
        weight = model.lm_head.weight.data
        q4q8 = any(isinstance(layer.quant_method, Q4Q8LinearMethod) for layer in linear_layers(model))
        # A quantized model's head takes the exact Q8 blocks x 16-bit fixed-point activations,
        # as its q4q8 linears do (2.4x faster; q4q8 layers exist only where the kernels run
        # Q4 blocks: AVX512-VNNI or AVX2), with panels of the weight from a measured row count.
        # Any other float32 head runs on panels of its weight where f32_linear has its AVX2
        # form, else on the exact Q8 blocks with float32 activations where there are some;
        # both give the float32 model's logprobs to 1e-5 (tests compare them with HF).
        # (the Q8 blocks are found only where they are used: not for a float32 head on panels)
        if q4q8 and (q8 := pack_q8_exact(weight)) is not None:
            processor.ops, processor.q8_vnni = ops, pack_q8_vnni(q8)
            bound["q8_lm_head"] = 1
            if keep_head_panels(model, ops):
                bound["lm_head_panels"] = 1
        elif float32_head_panels(model, ops):
            processor.ops = ops
            bound["lm_head_panels"] = 1
        elif (q8 := pack_q8_exact(weight)) is not None:
            processor.ops, processor.q8 = ops, q8
            bound["q8_lm_head"] = 1
        if FusedDecodeStack.fits(model.model):
            model.model.decode_stack = FusedDecodeStack(model.model, ops)
            bound["decode_stack"] = 1
    return bound


def _repack_float32_linears(
    model: nn.Module, name: str, pack: Callable[[torch.Tensor], torch.Tensor], method: LinearMethod, rows_of: int = 1
) -> int:
    """Every unquantized float32 CPU linear whose output rows are a multiple of `rows_of`:
    its weight becomes buffer `name` = pack(weight) and its method `method`; the plain
    weight goes (each method gives it back exactly: dequantize). Returns how many."""
    moved = 0
    for layer in linear_layers(model):
        weight = getattr(layer, "weight", None)
        if type(layer.quant_method) is not UnquantizedLinearMethod or weight is None:
            continue
        if weight.dtype != torch.float32 or not weight.is_cpu or weight.shape[0] % rows_of:
            continue
        layer.register_buffer(name, pack(weight.data), persistent=False)
        del layer.weight
        layer.quant_method = method
        moved += 1
    return moved


def use_f32_panels(model: nn.Module, ops: CpuOps) -> int:
    """Move every unquantized float32 linear onto f32_linear's panels where the kernels have
    its AVX2 form (not where oneDNN has AVX-512: use_onednn_packed). Returns how many."""
    if not ops.f32_linear_isa():
        return 0
    return _repack_float32_linears(model, "f32_panels", pack_f32_panels, F32PanelsLinearMethod(ops), rows_of=16)


def use_onednn_packed(model: nn.Module) -> int:
    """Where the panels are not built (AVX-512), move every unquantized float32 linear onto
    oneDNN's packed copy of its weight (OneDnnPackedLinearMethod: 1.3-1.8x F.linear's
    speed on a Zen 4). Returns how many."""
    if not torch.backends.mkldnn.is_available():
        return 0
    pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w, DENSE_PACK_ROWS)  # noqa: E731
    return _repack_float32_linears(model, "onednn_packed", pack, OneDnnPackedLinearMethod())


def float32_head_panels(model: LlamaForCausalLM, ops: CpuOps) -> bool:
    """A float32 head beside linears that are not q4q8, on f32_linear's panels of its weight
    at every row count, where the kernels have its AVX2 form and the copy fits
    DENSE_FLOAT32_MAX_BYTES:
    on a Zen 1 EPYC, SmolLM2's head took 5.4 / 14.4 ms at 1 / 16 rows there, 8.7 / 187 ms
    on the Q8 blocks with float activations (bench/RESULTS.md item 30). One kernel whatever
    the batch, so deterministic inference keeps it too."""
    processor, weight = model.logits_processor, model.lm_head.weight.data
    if not ops.f32_linear_isa() or weight.dtype != torch.float32 or weight.shape[0] % 16:
        return False
    if 4 * weight.numel() > DENSE_FLOAT32_MAX_BYTES:
        return False
    processor.panels, processor.panels_min_rows, processor.panels_batch_invariant = pack_f32_panels(weight), 0, True
    return True


def keep_head_panels(model: LlamaForCausalLM, ops: CpuOps) -> bool:
    """Beside q4q8 linears that run big batches on f32_linear's panels, run the LM head there
    too, from a row count measured here: on panels of its exact weights while they and the
    linears' float32 copies fit gguf.DENSE_FLOAT32_MAX_BYTES (+113 MB for SmolLM2), else on
    its own Q8 records, which f32_linear dequantizes as it goes (the same bits, no copy; 4%
    slower at 16 rows on a Zen 1). The Q8 blocks' integer products are compute-bound from a
    few rows on AVX2: SmolLM2's head at 16 rows took 18.4 ms on them, 14.3 on the panels, on
    a Zen 1 (bench/RESULTS.md items 28, 31)."""
    processor, weight = model.logits_processor, model.lm_head.weight.data
    q8 = processor.q8_vnni
    linears = [p for m in linear_layers(model) if (p := _panels(m)) is not None]
    if q8 is None or not linears:
        return False
    copies = sum(p.nbytes for p in linears if p.dtype == torch.float32)
    fits = copies > 0 and weight.shape[0] % 16 == 0 and copies + 4 * weight.numel() <= DENSE_FLOAT32_MAX_BYTES
    panels = pack_f32_panels(weight.float()) if fits else q8

    def calls(m: int) -> tuple[Callable[[], object], Callable[[], object]]:
        x = torch.randn(m, weight.shape[1])
        return (lambda: ops.q8_linear_vnni(x, q8)), (lambda: ops.f32_linear(x, panels))

    key = ("q8-head/f32-panels" if fits else "q8-head/q8-records", tuple(weight.shape))
    rows = crossover_for(key, lambda: time_crossover(calls))
    processor.panels, processor.panels_min_rows = panels, rows
    log.info("LM head runs big batches on panels", of="float32 copy" if fits else "Q8 records", panels_min_rows=rows)
    return True


def _layers(model: LlamaModel) -> list[LlamaDecoderLayer]:
    return cast(list[LlamaDecoderLayer], list(model.layers))


class _Stack(Protocol):  # kernels/cpu/decode_stack.cpp's DecodeStack
    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor, kv_idx: torch.Tensor, lens: torch.Tensor,
        token_req: torch.Tensor | None,
    ) -> torch.Tensor: ...  # fmt: skip


class FusedDecodeStack:
    """`LlamaModel`'s decoder layers for an all-decode batch as one `ops.DecodeStack` call.

    Only where that call is exactly the module path (`fits`): every linear q4q8 without
    bias, no q/k norm, float32 activations, one rank or ranks whose collectives run in
    shared memory (the stack calls that all-reduce after o_proj and down_proj, as the
    row-parallel modules do); and per batch only while the layers'
    dense copies would not take it (fewer than `dense_min_rows` rows; the stack runs the
    f32_linear panels itself, so with those it takes every size) and the attention
    backend runs one CPU kernel for every token (`decode_attention_plan`: paged_decode, or
    under deterministic inference the per-query kernel, whose q4q8 linears are
    batch-invariant as they are). The KV pool is made after the model: its
    buffers are bound on the first call with it."""

    def __init__(self, model: LlamaModel, ops: CpuOps) -> None:
        self.model, self.ops = model, ops
        self._stack: _Stack | None = None
        self._k0: torch.Tensor | None = None  # the pool the stack is bound to (its layer-0 K buffer)
        first = _layers(model)[0].self_attn.qkv_proj  # (one dense copy for every layer)
        self.max_rows = sys.maxsize if _panels(first) is not None else dense_min_rows(first) - 1

    @staticmethod
    def fits(model: LlamaModel) -> bool:
        for layer in _layers(model):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.q_norm is not None or attn.ops is None or (attn.qkv_proj.tp_size > 1 and shm_group() is None):
                return False
            if any(not isinstance(m.quant_method, Q4Q8LinearMethod) or m.bias is not None for m in linears):
                return False
        return model.embed_tokens.weight.dtype == torch.float32 and len(model.layers) > 0

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, fb: AttentionBatch) -> torch.Tensor | None:
        """The final norm's output, or None where the module path must run."""
        plan = fb.attn_backend.decode_attention_plan()
        if plan is None or h.shape[0] > self.max_rows:  # (h is float32: `fits`)
            return None
        pool = fb.kv_pool
        if self._stack is None or self._k0 is not pool.k_buffer[0]:
            self._stack, self._k0 = self._build(pool.k_buffer, pool.v_buffer), pool.k_buffer[0]
        return self._stack.forward(h, positions, fb.out_cache_loc, plan.kv_idx, plan.lens, plan.token_req)

    def _build(self, k_buffer: list[torch.Tensor], v_buffer: list[torch.Tensor]) -> _Stack:
        per_layer: list[torch.Tensor] = []
        none = torch.empty(0)
        for i, layer in enumerate(_layers(self.model)):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            per_layer += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            per_layer += [cast(torch.Tensor, m.q4_weight) for m in linears]
            per_layer += [p if (p := _panels(m)) is not None else none for m in linears]
            per_layer += [k_buffer[i], v_buffer[i]]
        first = _layers(self.model)[0]
        attn = first.self_attn
        # A generated token takes the blocks under deterministic inference (PromptRows), as
        # the module path's linears do there: no panels at any size.
        qkv = attn.qkv_proj
        min_rows = sys.maxsize if qkv.batch_invariant or _panels(qkv) is None else dense_min_rows(qkv)
        group = shm_group() if qkv.tp_size > 1 else None
        return cast(_Stack, self.ops.DecodeStack(
            per_layer, self.model.norm.weight, self.model.rotary_emb.cos_sin_cache,
            attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.attn.scaling, first.input_layernorm.eps,
            min_rows, None if group is None else group.comm, 0.0 if group is None else group.timeout_s,
        ))  # fmt: skip


def _panels(layer: LinearBase) -> torch.Tensor | None:
    """What the layer's f32_linear takes (int4.keep_dense_copy's panels, or its records past
    the float32 budget: gguf.GgufLinearMethod), if anything."""
    return cast(torch.Tensor | None, getattr(layer, "dense_panels", None))


def make_batch_invariant(model: nn.Module) -> None:
    """Every matmul's rows independent of the batch: see runtime/layers/batch_invariant.py."""
    for module in model.modules():
        if isinstance(module, (LinearBase, LogitsProcessor)):
            module.batch_invariant = True
