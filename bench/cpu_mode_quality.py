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
"""

from __future__ import annotations

import argparse
import glob
from pathlib import Path
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
    parser.add_argument("--modes", nargs="+", choices=["default", "int4", "kv", "bf16"], default=["default", "int4", "kv", "bf16"])
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
    if "bf16" not in args.modes:
        return
    bf16 = ModelConfig.from_pretrained(model_dir, torch.bfloat16, context_length=512)
    print(f"{'bf16':24s} %.4f %.4f" % agreement(logits(load_model(model_dir, bf16, "auto", "cpu", seed=None), bf16), ref))


if __name__ == "__main__":
    main()
