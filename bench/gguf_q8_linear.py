"""Q8_0 linear layers under `--quantization gguf`: why two int4 planes, not int8.

A Q8_0 block (32 int8 codes, one fp16 scale) has no exact form in torch's per-channel
int8 kernel, whose one scale per row must cover the row's largest block. This compares,
on SmolLM2's MLP shapes with Gaussian weights quantized to Q8_0 by gguf-py, at M = 1:

    int4x2   the gguf path: two int4 planes summed in one `_weight_int4pack_mm_for_cpu`
    int8     the dequantized Q8_0 weight re-quantized per output channel (`--quantization int8`'s method)
    bf16     F.linear on the dequantized weight in bfloat16

ms per call (best of 5 rounds) and the output's relative error against a float64
matmul with gguf-py's dequantized weight (activations rounded to bfloat16 for all).

    python -m bench.gguf_q8_linear [--threads N]
"""

from __future__ import annotations

import argparse
from typing import Any

SHAPES = [(576, 1536), (1536, 576)]  # (in, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores).")


def main(args: argparse.Namespace) -> int:
    import functools

    import gguf
    import torch

    from bench.quant_linear import best_ms
    from runtime.layers.linear import ColumnParallelLinear, LinearBase
    from runtime.layers.quantization import (
        prepare_linear_layers,
        quantize_linear_layers,
    )
    from runtime.layers.quantization.gguf_blocks import GgufTensor, GgufWeight
    from runtime.layers.quantization.int8 import Int8LinearMethod

    if args.threads:
        torch.set_num_threads(args.threads)
    q8 = gguf.GGMLQuantizationType.Q8_0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; M = 1")
    print(f"{'in x out':>12} {'variant':>7} {'ms/call':>8} {'rel err':>8}")
    for k, n in SHAPES:
        torch.manual_seed(0)
        raw = gguf.quantize((torch.randn(n, k) * 0.02).numpy(), q8)
        weight = torch.from_numpy(gguf.dequantize(raw, q8).reshape(n, k).copy())
        layers: dict[str, LinearBase] = {}
        packed = ColumnParallelLinear(k, n)
        holder = torch.nn.Sequential(packed)
        prepare_linear_layers(holder, "gguf")
        packed.weight_loader(packed.weight, GgufWeight.of_tensor(GgufTensor("w", q8, (n, k), raw)), None)
        quantize_linear_layers(holder, "gguf")
        layers["int4x2"] = packed
        layers["int8"] = ColumnParallelLinear(k, n)
        layers["int8"].weight.data.copy_(weight)
        layers["int8"].quant_method = Int8LinearMethod()
        layers["int8"].quant_method.process_weights_after_loading(layers["int8"])
        layers["bf16"] = ColumnParallelLinear(k, n).to(torch.bfloat16)
        layers["bf16"].weight.data.copy_(weight)
        x = torch.randn(1, k).bfloat16()
        ref = x.double() @ weight.double().T
        for name, layer in layers.items():
            with torch.no_grad():
                y: Any = layer(x)
                ms = best_ms(functools.partial(layer, x), 2000)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            print(f"{k:>5}x{n:<6} {name:>7} {ms:8.4f} {err:8.4f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.gguf_q8_linear", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
