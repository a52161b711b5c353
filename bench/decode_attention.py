"""`sluice bench decode-attention`: one decode step's attention, side by side.

Times every layer's decode attention for a batch of `--batch-size` sequences of
`--context-len` cached tokens, the way the torch backend runs it on CPU: the
compiled paged kernel reading KV in place, with a float32 and a bfloat16 KV
cache, and torch's gather + SDPA path. Slots are laid out as the allocator
hands them out (each sequence contiguous, sequences one after another). The
variants alternate within each repeat, so machine noise hits them alike; the
report is the median per variant and its ratio to the first.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.metrics import save_records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=128, help="Sequences decoding together.")
    parser.add_argument("--context-len", type=int, default=330, help="Cached tokens per sequence.")
    parser.add_argument("--num-layers", type=int, default=30, help="Layers per step (SmolLM2-135M: 30).")
    parser.add_argument("--num-heads", type=int, default=9, help="Query heads.")
    parser.add_argument("--num-kv-heads", type=int, default=3, help="KV heads.")
    parser.add_argument("--head-dim", type=int, default=64, help="Head dimension.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed steps per variant (after one warm-up).")
    parser.add_argument("--output-file", default=None, help="Append one JSON line.")


def _variants(ns: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from kernels.cpu import load_paged_decode

    kernel = load_paged_decode()
    if kernel is None:
        raise SystemExit("the CPU paged-decode kernel did not build (needs g++ and ninja)")
    n, ctx, hq, hkv, d = ns.batch_size, ns.context_len, ns.num_heads, ns.num_kv_heads, ns.head_dim
    slots = n * ctx + 1
    gen = torch.Generator().manual_seed(0)
    k32 = [torch.randn(slots, hkv, d, generator=gen) for _ in range(ns.num_layers)]
    v32 = [torch.randn(slots, hkv, d, generator=gen) for _ in range(ns.num_layers)]
    k16, v16 = [k.bfloat16() for k in k32], [v.bfloat16() for v in v32]
    idx = (torch.arange(n * ctx) + 1).view(n, ctx)
    lens = torch.full((n,), ctx, dtype=torch.int64)
    q = torch.randn(n, hq, d, generator=gen)
    scale = d**-0.5

    def paged(ks: list[Any], vs: list[Any]) -> None:
        for k, v in zip(ks, vs):
            kernel(q, k, v, idx, lens, scale)

    def gather_sdpa() -> None:
        for k, v in zip(k32, v32):
            kd, vd = k[idx].transpose(1, 2), v[idx].transpose(1, 2)
            F.scaled_dot_product_attention(q[:, :, None, :], kd, vd, scale=scale, enable_gqa=True)

    return {
        "kernel, float32 KV": lambda: paged(k32, v32),
        "kernel, bfloat16 KV": lambda: paged(k16, v16),
        "torch gather + SDPA, float32 KV": gather_sdpa,
    }


def main(ns: argparse.Namespace) -> int:
    variants = _variants(ns)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(ns.repeats + 1):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            if rep:  # the first round warms caches and allocators
                times[name].append(time.perf_counter() - start)
        print(f"repeat {rep}/{ns.repeats}", flush=True)
    kv_bytes = ns.batch_size * ns.context_len * ns.num_layers * 2 * ns.num_kv_heads * ns.head_dim
    medians = {name: statistics.median(t) for name, t in times.items()}
    first = next(iter(medians.values()))
    print(f"decode attention, {ns.num_layers} layers, bs={ns.batch_size}, context={ns.context_len}")
    for name, m in medians.items():
        print(f"  {name:34s} {m * 1e3:9.1f} ms   x{first / m:5.2f} vs first")
    record = {"median_ms": {k: v * 1e3 for k, v in medians.items()}, "float32_kv_gb_per_step": kv_bytes * 4 / 1e9}
    save_records(ns.output_file, "decode-attention", [record], ns)
    return 0
