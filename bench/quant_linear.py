"""Weight-only int8 / int4 linear (`--quantization`) vs float F.linear on CPU, per call.

Times the layers' own `forward` (so the bfloat16 cast in and out of the quantized
kernels is included) on SmolLM2-135M's linear shapes: q|k|v-sized 576x1536 is the
gate|up shape's half, 1536x576 is down_proj, 576x49152 the LM-head shape (which
sluice keeps float; timed here only as the largest matmul). Each figure is the best
of several timed rounds, which filters out other processes' interference.

    sluice bench quant-linear [--threads N] [--batch-size 1 16 64 256] [--output-file F]
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from runtime.layers.linear import ColumnParallelLinear, LinearBase
from runtime.layers.quantization.int4 import Int4LinearMethod
from runtime.layers.quantization.int8 import Int8LinearMethod

SHAPES = [(576, 1536), (1536, 576), (576, 49152)]  # (in, out)
VARIANTS = ["fp32", "bf16", "int8", "int4-g32"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores).")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64], help="Rows M per call.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per (shape, M).")


def best_ms(fn: Callable[[], torch.Tensor], calls: int, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def layers(k: int, n: int) -> dict[str, LinearBase]:
    out: dict[str, LinearBase] = {}
    for name, dtype, method in [
        ("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
        ("int8", torch.float32, Int8LinearMethod()), ("int4-g32", torch.float32, Int4LinearMethod(32)),
    ]:  # fmt: skip
        layer = ColumnParallelLinear(k, n).to(dtype)
        layer.weight.data.normal_(0.0, 0.02)
        if method is not None:
            layer.quant_method = method
            method.process_weights_after_loading(layer)
        out[name] = layer
    return out


@torch.no_grad()
def main(args: argparse.Namespace) -> int:
    from bench.metrics import save_records

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per call (best of 5 rounds)")
    print(f"{'in x out':>12} {'M':>3} " + " ".join(f"{c:>9}" for c in VARIANTS))
    records = []
    for k, n in SHAPES:
        by_name = layers(k, n)
        for m in args.batch_size:
            x = torch.randn(m, k)
            calls = max(3, int(2e7 / (k * n * max(m, 4))))
            row = [best_ms(functools.partial(layer, x.to(layer_dtype(layer))), calls) for layer in by_name.values()]
            print(f"{k:>5}x{n:<6} {m:>3} " + " ".join(f"{t:9.3f}" for t in row))
            records.append({"in": k, "out": n, "m": m, **{f"{v}_ms": t for v, t in zip(VARIANTS, row)}})
    save_records(args.output_file, "quant-linear", records, args)
    return 0


def layer_dtype(layer: LinearBase) -> torch.dtype:
    return layer.weight.dtype if "weight" in layer._parameters else torch.float32
