"""Switches a built model onto the CPU fast path and the batch-invariant path.

`bind_cpu_ops` hands the compiled kernels (kernels/cpu) to every layer that has a
fused form: RMSNorm (+ residual), RoPE on the fused qkv, SiLU·mul, and the LM head
as exact Q8 blocks. Each such layer holds `ops = None` until then and runs its torch
code; with ops bound it runs the kernel, with the same numerics (math in float32,
the same roundings to the model dtype).

`make_batch_invariant` is `--enable-deterministic-inference` on the model side:
float matmuls run in fixed row blocks (runtime/layers/batch_invariant.py); the
attention side is the backend's (kernels/attention/torch_native.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from runtime.layers.activation import SiluAndMulMLP
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import LinearBase
from runtime.layers.logits_processor import LogitsProcessor
from runtime.layers.quantization import linear_layers
from runtime.layers.quantization.q4q8 import Q4Q8LinearMethod
from runtime.layers.quantization.q8 import pack_q8_exact, pack_q8_vnni
from runtime.models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from kernels.cpu import CpuOps


def bind_cpu_ops(model: nn.Module, ops: CpuOps) -> dict[str, int]:
    """Give `ops` to the layers that have a fused form; returns how many of each took it."""
    bound: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMulMLP, LlamaAttention)):
            module.ops = ops
            bound[type(module).__name__] = bound.get(type(module).__name__, 0) + 1
    if isinstance(model, LlamaForCausalLM):
        processor: LogitsProcessor = model.logits_processor
        processor.q8 = pack_q8_exact(model.lm_head.weight.data)
        if processor.q8 is not None:
            processor.ops = ops
            bound["q8_lm_head"] = 1
            # A quantized model's head takes the blocks x 16-bit fixed-point activations too
            # (q4q8.py's way, 2.4x faster); an unquantized one keeps float32 activations, whose
            # logprobs equal the float32 model's to 1e-5 (tests compare them with HF).
            # (q4q8 layers exist only where the CPU has VNNI)
            if any(isinstance(layer.quant_method, Q4Q8LinearMethod) for layer in linear_layers(model)):
                processor.q8 = processor.q8._replace(vnni=pack_q8_vnni(processor.q8))
    return bound


def make_batch_invariant(model: nn.Module) -> None:
    """Every matmul's rows independent of the batch: see runtime/layers/batch_invariant.py."""
    for module in model.modules():
        if isinstance(module, (LinearBase, LogitsProcessor)):
            module.batch_invariant = True
