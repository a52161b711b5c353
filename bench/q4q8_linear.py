"""A decode step's linear layers, five ways: q4q8 vs torch's int4 kernel vs bfloat16, and
float32 GEMMs on the records or on a float32 copy.

SmolLM2-135M's 120 linears (30 layers x qkv 960x576, o 576x576, gate|up 3072x576,
down 576x1536) with random Q4_1-shaped blocks, each layer its own weights so that a
pass streams them from memory as a real step does (66 MB for q4q8), at M rows:

    q4q8   kernels/cpu/q4_linear.cpp: the blocks x 16-bit fixed-point activations (VNNI / AVX2)
    int4   torch's `_weight_int4pack_mm_for_cpu` on the same weights (bf16 activations)
    bf16   F.linear on the dequantized weights in bfloat16 (oneDNN: AMX / AVX512-BF16)
    records  kernels/cpu/f32_linear.cpp on the q4q8 records, each panel dequantized as it goes
    panels   the same loop on a float32 copy (pack_f32_panels: 8x the bytes; the records' bits)

ms per pass of 120 layers, the median of `--rounds` passes (after one warm-up). The
int4 kernel is skipped from 64 rows on (its time grows linearly in M).

    python -m bench.q4q8_linear [--threads 2 1] [--rows 1 4 16 32 64 128] [--ways q4q8 records panels] [--output-file F]
"""

from __future__ import annotations

import argparse
import statistics
import time

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per decoder layer
LAYERS = 30


def main() -> None:
    import torch

    from bench.metrics import save_records
    from kernels.cpu import load_cpu_ops
    from runtime.layers.quantization.int4 import pack_f32_panels, pack_int4, quantize_int4_values
    from runtime.layers.quantization.q4q8 import pack_q4

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ways", nargs="+", choices=["q4q8", "int4", "bf16", "records", "panels"], default=["q4q8", "int4", "bf16"],
                        help="Which to time. One per process is the fair comparison: each pool's helper threads "
                        "(OpenMP's for int4/bf16, kernels/cpu/spin_pool.h's for q4q8) spin a while after a pass "
                        "and slow the other's next pass.")
    parser.add_argument("--output-file", default=None)
    args = parser.parse_args()
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels did not build here")
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            d, m = (torch.rand(n, k // 32) * 0.01).half(), (-torch.rand(n, k // 32) * 0.08).half()
            w = (q.float().view(n, k // 32, 32) * d.float()[..., None] + m.float()[..., None]).view(n, k)
            codes, scales_and_zeros = quantize_int4_values(w, 32)
            panels = pack_f32_panels(w) if "panels" in args.ways else None
            layers.append((k, pack_q4(q, d, m), pack_int4(codes), scales_and_zeros, w.bfloat16(), panels))
    records = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            x = {k: torch.randn(rows, k) for k in (576, 1536)}
            xb = {k: v.bfloat16() for k, v in x.items()}
            ways = {
                "q4q8": lambda: [ops.q4_linear(x[k], p) for k, p, *_ in layers],
                "int4": lambda: [torch._weight_int4pack_mm_for_cpu(xb[k], p, 32, sz) for k, _, p, sz, _ in layers],
                "bf16": lambda: [torch.nn.functional.linear(xb[k], w) for k, _, _, _, w, _ in layers],
                "records": lambda: [ops.f32_linear(x[k], p) for k, p, *_ in layers],
                "panels": lambda: [ops.f32_linear(x[k], p) for k, *_, p in layers],
            }
            ways = {name: run for name, run in ways.items() if name in args.ways and not (name == "int4" and rows >= 64)}
            times: dict[str, list[float]] = {name: [] for name in ways}
            for r in range(args.rounds + 1):  # interleaved, so a noisy machine hits all alike
                for name, run in ways.items():
                    start = time.perf_counter()
                    run()
                    if r:
                        times[name].append((time.perf_counter() - start) * 1e3)
            ms = {name: round(statistics.median(t), 2) for name, t in times.items()}
            print(f"threads {threads}  rows {rows:4d}  " + "  ".join(f"{n} {v:8.2f} ms" for n, v in ms.items()), flush=True)
            records.append({"threads": threads, "rows": rows, **{f"{n}_ms": v for n, v in ms.items()}})
    if args.output_file:
        save_records(args.output_file, "q4q8_linear", records, args)


if __name__ == "__main__":
    main()
