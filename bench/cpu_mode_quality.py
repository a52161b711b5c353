"""`python -m bench.cpu_mode_quality`: the CPU modes' agreement with the float32 model
over a larger text than bench.quant_model's 222 held-out tokens.

Teacher forcing over `--windows` windows of 128 tokens of this repository's docs
(docs/*.md, README.md), each window one 112-token prefill then 16 decode steps (so
both the prefill path and the decode path of a mode are measured), against the
float32 conversion of the embedded GGUF:

  default      quantization=auto (gguf: the Q4 blocks through q4q8 on a VNNI or AVX2 CPU,
               their dense copy for batches of >= 32 rows), fused CPU kernels, exact Q8 LM head
  default only the same without the dense copy (every matmul through the packed kernel)
  default, X KV the default with a float16 / bfloat16 KV cache (--kv-cache-dtype)
  int4         gguf through torch's int4 kernel (bf16 activations), with / without the copy
  bf16         a bfloat16 model without quantization (the previous default on AMX CPUs)
  kv8          an 8-bit KV cache, simulated: the default's module path (no fused decode stack,
               torch attention) with each token's K and/or V rounded per kv head to int8
               (symmetric, scale max|x| / 127) before the cache, against the same path unrounded
"""

from __future__ import annotations

import argparse
import glob
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels.cpu import CpuOps


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from bench.paged_rounds import teacher_forced
    from bench.quant_model import agreement
    from kernels.cpu import PinnedIsa, load_cpu_ops
    from runtime.model_config import ModelConfig
    from runtime.model_executor.model_loader import load_model, prepare_model_dir
    from runtime.models.cpu_path import bind_cpu_ops
    from runtime.layers.quantization.int4 import drop_dense_copy

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=24, help="128-token windows of docs text.")
    parser.add_argument("--modes", nargs="+", choices=["default", "int4", "kv", "kv8", "bf16"], default=["default", "int4", "kv", "bf16"])
    parser.add_argument("--kv-cache-dtypes", nargs="*", default=["float16", "bfloat16"], help="Narrow KV caches to try.")
    parser.add_argument("--bf16-isa", default="", help="Pin the dense path's kernel to one of bf16_linear_isas() "
                        "(avx512-bf16 on an AMX CPU: what CPUs without AMX get), or none: oneDNN's bf16 copy.")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    model_dir = prepare_model_dir(None, "auto")
    text = "\n".join(Path(p).read_text() for p in [*sorted(glob.glob(str(root / "docs" / "*.md"))), str(root / "README.md")])
    ids = AutoTokenizer.from_pretrained(model_dir).encode(text)
    windows = [ids[i : i + 128] for i in range(0, min(len(ids) - 127, args.windows * 128), 128)]
    ops = load_cpu_ops()
    if ops is not None and args.bf16_isa:
        try:
            ops = PinnedIsa(ops, args.bf16_isa)
        except ValueError as exc:
            raise SystemExit(f"--bf16-isa: {exc}") from None

    def logits(model: torch.nn.Module, config: ModelConfig) -> torch.Tensor:
        return teacher_forced(model, config, windows)

    f32 = ModelConfig.from_pretrained(model_dir, torch.float32, context_length=512)
    ref = logits(load_model(model_dir, f32, "auto", "cpu", seed=None), f32)
    print(f"{len(windows) * 128} tokens; top-1 agreement, mean |delta logprob| vs float32")
    # default: with the kernels, Q4 layers are q4q8 (int8 activations) on a VNNI or AVX2 CPU;
    # "int4": torch's int4 kernel (bf16 activations), the form without that kernel.
    for name, kernel_ops in [("default", ops), ("int4", None)]:
        if name not in args.modes:
            continue
        model = load_model(model_dir, f32, "auto", "cpu", seed=None, quantization="gguf", cpu_ops=kernel_ops)
        if ops is not None:
            bind_cpu_ops(model, ops)
        print(f"{name + ' (+dense copy)':24s} %.4f %.4f" % agreement(logits(model, f32), ref))
        for module in model.modules():
            drop_dense_copy(module)
        print(f"{name + ' only':24s} %.4f %.4f" % agreement(logits(model, f32), ref))
    # The default's decode path with a narrower KV cache (half the bytes a decode step reads).
    for kv in args.kv_cache_dtypes if "kv" in args.modes else []:
        narrow = ModelConfig.from_pretrained(model_dir, torch.float32, context_length=512, kv_cache_dtype=kv)
        model = load_model(model_dir, narrow, "auto", "cpu", seed=None, quantization="gguf", cpu_ops=ops)
        if ops is not None:
            bind_cpu_ops(model, ops)
        print(f"{'default, ' + kv + ' KV':24s} %.4f %.4f" % agreement(logits(model, narrow), ref))
    if "kv8" in args.modes:
        kv8(model_dir, ops, logits, ref)
    if "bf16" not in args.modes:
        return
    bf16 = ModelConfig.from_pretrained(model_dir, torch.bfloat16, context_length=512)
    print(f"{'bf16':24s} %.4f %.4f" % agreement(logits(load_model(model_dir, bf16, "auto", "cpu", seed=None), bf16), ref))


def kv8(model_dir: Path, ops: CpuOps | None, logits: Callable[..., Any], ref: Any) -> None:
    """The default model on its module path, each token's K and/or V rounded to int8 per kv
    head on their way into the cache (a forward pre-hook on every RadixAttention)."""
    import torch

    from bench.quant_model import agreement
    from runtime.layers.attention import RadixAttention
    from runtime.model_config import ModelConfig
    from runtime.model_executor.model_loader import load_model
    from runtime.models.cpu_path import bind_cpu_ops

    def int8(x: torch.Tensor) -> torch.Tensor:  # [T, H, D], a scale per token and head
        scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
        return (torch.round(x.float() / scale).clamp(-127, 127) * scale).to(x.dtype)

    config = ModelConfig.from_pretrained(model_dir, torch.float32, context_length=512, kv_cache_dtype="float16")
    model = load_model(model_dir, config, "auto", "cpu", seed=None, quantization="gguf", cpu_ops=ops)
    if ops is not None:
        bind_cpu_ops(model, ops)
    model.model.decode_stack = None  # (its C++ writes the KV itself)
    for name, k8, v8 in [("module path, float16 KV", False, False), ("int8 K and V", True, True),
                         ("int8 K only", True, False), ("int8 V only", False, True)]:  # fmt: skip
        def hook(_m: RadixAttention, args: tuple[Any, ...], k8: bool = k8, v8: bool = v8) -> tuple[Any, ...]:
            q, k, v, fb = args
            return q, int8(k) if k8 else k, int8(v) if v8 else v, fb

        handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, RadixAttention)]
        print(f"{'kv8: ' + name:24s} %.4f %.4f" % agreement(logits(model, config), ref))
        for h in handles:
            h.remove()


if __name__ == "__main__":
    main()
