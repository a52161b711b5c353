"""Weight-only quantization of the linear layers (`--quantization`), CPU only.

A quantized model loads exactly like a float one: every `LinearBase` is built with
the float `[out, in]` weight and filled through its `weight_loader`, so each
tensor-parallel rank reads its own shard unchanged. Once all weights are in,
`quantize_linear_layers` hands each linear layer its method, whose
`process_weights_after_loading` replaces the float weight by packed tensors (each
rank packs its own shard). The embedding and the LM head are not `LinearBase` and
stay float (the LM head's 49152x576 matmul is the one most sensitive to error).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from runtime.layers.linear import LinearBase, LinearMethod, UnquantizedLinearMethod
from runtime.layers.quantization.int4 import Int4LinearMethod
from runtime.layers.quantization.int8 import Int8LinearMethod

QuantizationName = Literal["none", "int8", "int4"]


def get_linear_method(name: QuantizationName) -> LinearMethod:
    if name == "none":
        return UnquantizedLinearMethod()
    if name == "int8":
        return Int8LinearMethod()
    if name == "int4":
        return Int4LinearMethod()
    raise ValueError(f"unknown quantization {name!r} (none, int8, int4)")


def quantize_linear_layers(model: nn.Module, name: QuantizationName) -> None:
    """Pack every loaded `LinearBase` of `model` with `name`'s method (a no-op for none)."""
    if name == "none":
        return
    method = get_linear_method(name)  # stateless: one instance serves every layer
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method = method
            method.process_weights_after_loading(module)
