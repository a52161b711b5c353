"""Weight-only quantization of the linear layers (`--quantization`), CPU only.

int8 / int4: a quantized model loads exactly like a float one: every `LinearBase` is
built with the float `[out, in]` weight and filled through its `weight_loader`, so
each tensor-parallel rank reads its own shard unchanged. Once all weights are in,
`quantize_linear_layers` hands each linear layer its method, whose
`process_weights_after_loading` replaces the float weight by packed tensors (each
rank packs its own shard).

gguf: the checkpoint already is quantized. `prepare_linear_layers` gives every linear
layer its own `GgufLinearMethod` before loading, which keeps the GGUF blocks its
weight_loader receives; `quantize_linear_layers` then has each one pack them
(runtime/layers/quantization/gguf.py).

The embedding and the LM head are not `LinearBase` and stay float (the LM head's
49152x576 matmul is the one most sensitive to error).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn

from runtime.layers.linear import (
    F32PanelsLinearMethod,
    LinearBase,
    LinearMethod,
    OneDnnPackedLinearMethod,
    UnquantizedLinearMethod,
)
from runtime.layers.quantization.gguf import GgufLinearMethod, Int4PlanesLinearMethod, dense_dtype
from runtime.layers.quantization.int4 import Int4LinearMethod
from runtime.layers.quantization.int8 import Int8LinearMethod
from runtime.layers.quantization import q4q8
from runtime.layers.quantization.q4q8 import Q4Q8LinearMethod
from runtime.layers.weights import checkpoint_shapes_of, set_weight_attrs

if TYPE_CHECKING:
    from kernels.cpu import CpuOps

QuantizationName = Literal["none", "int8", "int4", "gguf"]


def get_linear_method(name: QuantizationName) -> LinearMethod:
    """The method that packs a loaded float layer (gguf has none: see prepare_linear_layers)."""
    if name == "none":
        return UnquantizedLinearMethod()
    if name == "int8":
        return Int8LinearMethod()
    if name == "int4":
        return Int4LinearMethod()
    if name == "gguf":
        raise ValueError("gguf layers are packed from the checkpoint's blocks: use prepare_linear_layers before loading")
    raise ValueError(f"unknown quantization {name!r} for float weights (none, int8, int4)")


def linear_form(layer: LinearBase) -> str:
    """What a layer computes with: float, float-panels (the same weight in f32_linear's
    layout), float-onednn (in oneDNN's blocked layout), int8, int4, int4x<P> (P int4 planes
    summed), or q4q8 (Q4 blocks x int8 activations)."""
    method = layer.quant_method
    if isinstance(method, Q4Q8LinearMethod):
        return "q4q8"
    if isinstance(method, Int4PlanesLinearMethod):
        return f"int4x{method.planes}"
    if isinstance(method, Int4LinearMethod):
        return "int4"
    if isinstance(method, Int8LinearMethod):
        return "int8"
    if isinstance(method, F32PanelsLinearMethod):
        return "float-panels"
    if isinstance(method, OneDnnPackedLinearMethod):
        return "float-onednn"
    return "float" if type(method) is UnquantizedLinearMethod else type(method).__name__


def linear_layers(model: nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def prepare_linear_layers(model: nn.Module, name: QuantizationName, ops: CpuOps | None = None) -> None:
    """Before loading: for gguf, every linear layer's weight becomes a placeholder that
    its own GgufLinearMethod fills (same name, shape and weight_loader); the float
    weight the constructor made, never written, is dropped. `ops`: the CPU kernels the
    model will run with (Q4 layers take q4q8 where they can). Other names load float
    weights as built."""
    if name != "gguf":
        return
    layers = linear_layers(model)
    if not layers:
        return
    dense = dense_dtype(layers[0].weight.device, sum(layer.weight.numel() for layer in layers))
    for layer in layers:
        float_weight = layer.weight
        method = GgufLinearMethod(float_weight.dtype, float_weight.device, ops, dense)
        layer.quant_method = method
        method.create_weights(layer, layer.input_size_per_partition, layer.output_size_per_partition)
        set_weight_attrs(layer.weight, layer.weight_loader, checkpoint_shapes_of(float_weight))


def dense_path(model: nn.Module, ops: CpuOps | None) -> str:
    """What packed layers run batches of dense_min_rows rows or more on (logged at load):
    the kernels' bf16 tiles on one ISA, their float32 panels (avx2-float32), oneDNN's copy
    in its dtype, or none (the packed kernel for every batch)."""
    for layer in linear_layers(model):
        if hasattr(layer, "dense_tiles") and ops is not None:
            return ops.bf16_linear_isas()[0]
        if hasattr(layer, "dense_panels") and ops is not None:
            return f"{ops.f32_linear_isa()}-float32"
        for name in ("dense_packed", "dense_weight"):
            if hasattr(layer, name):
                return f"onednn-{str(getattr(layer, name).dtype).removeprefix('torch.')}"
    return "none"


def settle_dense_min_rows(model: nn.Module, ops: CpuOps | None) -> int | None:
    """Where `model`'s q4q8 layers keep float32 panels: the rows from which they take them,
    measured here on the model's own layers (q4q8.measure_panels_min_rows; a later load of
    the same shapes in this process reuses it) and set on each as `panels_min_rows`.
    None where no layer has panels."""
    layers = [m for m in linear_layers(model) if isinstance(m.quant_method, Q4Q8LinearMethod) and hasattr(m, "dense_panels")]
    if not layers or ops is None:
        return None
    timed = q4q8.panels_timed(layers)
    key = ("q4-blocks/f32-panels", *(tuple(cast(torch.Tensor, m.dense_panels).shape) for m in timed))
    rows = q4q8.crossover_for(key, lambda: q4q8.measure_panels_min_rows(timed, ops))
    for layer in layers:
        layer.panels_min_rows = rows
    return rows


def quantize_linear_layers(model: nn.Module, name: QuantizationName) -> Counter[str]:
    """After loading: pack every `LinearBase` of `model` with `name`'s method (a no-op for
    none). Returns how many layers took each form (`linear_form`: int4, int4x2, float...)."""
    if name == "none":
        return Counter()
    forms: Counter[str] = Counter()
    shared = None if name == "gguf" else get_linear_method(name)  # stateless: one serves every layer
    for layer in linear_layers(model):
        method = layer.quant_method if shared is None else shared
        if name == "gguf" and not isinstance(method, GgufLinearMethod):
            raise TypeError("quantization=gguf: call prepare_linear_layers before loading")
        layer.quant_method = method
        method.process_weights_after_loading(layer)
        forms[linear_form(layer)] += 1
    return forms
