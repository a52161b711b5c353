"""`sluice bench serving --compare-llamacpp BIN`: the same requests against sluice and a
llama-server side by side (bench/serving_client.py runs each side; bench/llamacpp.py owns the
llama-server process), in `--compare-rounds` alternating rounds, and the ratio table.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.metrics import WIDTH, rule, save_records
from bench.serving_client import Workload, bench_server, build_workload

# llama-server has no /generate: token-id prompts go to its /v1/completions instead.
LLAMACPP_BACKEND = {"sluice": "openai", "openai": "openai", "openai-chat": "openai-chat"}
CHAT_TEMPLATE_MARGIN = 64  # tokens a chat template may add to a prompt (for llama-server's context size)

# (label, metric key, higher is better)
COMPARED = (
    ("Output token throughput (tok/s)", "output_throughput", True),
    ("Median TTFT (ms)", "median_ttft_ms", False),
    ("P99 TTFT (ms)", "p99_ttft_ms", False),
    ("Median ITL (ms)", "median_itl_ms", False),
    ("P99 ITL (ms)", "p99_itl_ms", False),
    ("Median TPOT (ms)", "median_tpot_ms", False),
    ("Median E2E latency (ms)", "median_e2e_ms", False),
)


def format_comparison(sluice: dict[str, Any], llama: dict[str, Any], rounds: list[float] | None = None) -> str:
    """One row per metric: sluice, llama.cpp, and the ratio sluice / llama.cpp; with
    several rounds, the metrics are each engine's medians and the rounds' throughput
    ratios follow."""

    def line(label: str, a: Any, b: Any, ratio: Any) -> str:
        return f"{label:<34} {a:>12} {b:>12} {ratio:>10}"

    title = " sluice vs llama.cpp " if not rounds or len(rounds) == 1 else f" sluice vs llama.cpp, medians of {len(rounds)} rounds "
    lines = [rule(title, "="), line("", "sluice", "llama.cpp", "ratio")]
    for label, key, higher_better in COMPARED:
        a, b = float(sluice[key]), float(llama[key])
        ratio = f"{a / b:.2f}" if b > 0 else "n/a"
        lines.append(line(label, f"{a:.2f}", f"{b:.2f}", ratio + (" ↑" if higher_better else " ↓")))
    for label, key in (("Completed requests", "completed"), ("Failed requests", "failed"),
                       ("Total generated tokens", "total_output_tokens"), ("Output length mismatches", "output_len_mismatches")):
        lines.append(line(label, sluice[key], llama[key], ""))
    if rounds and len(rounds) > 1:
        lines.append("Throughput ratio by round: " + ", ".join(f"{r:.2f}" for r in rounds))
    lines.append("ratio = sluice / llama.cpp; ↑ higher is better for sluice, ↓ lower is better")
    lines.append("=" * max(WIDTH, len(lines[1])))
    return "\n".join(lines)


def median_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-metric medians of several runs' records (the compared and counted keys)."""
    import statistics

    keys = [key for _, key, _ in COMPARED]
    counts = ("completed", "failed", "total_output_tokens", "output_len_mismatches")
    return {**{k: statistics.median(float(r[k]) for r in records) for k in keys}, **{k: sum(r[k] for r in records) for k in counts}}


def llamacpp_context(work: Workload, parallel: int) -> int:
    """-c for llama-server: every slot holds the longest request (plus a chat template's tokens)."""
    longest = max(r.prompt_len + r.output_len for r in work.requests + work.warm) + CHAT_TEMPLATE_MARGIN
    return parallel * longest


async def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The run against the sluice server, then the identical requests against a
    llama-server; with --compare-rounds N, N such pairs, each on fresh requests (a
    llama-server's prompt cache would otherwise serve a repeated prompt)."""
    from bench.llamacpp import LlamaServer

    sluice, work = await bench_server(args, args.base_url, args.backend, flush=not args.no_flush_cache, title=" sluice ")
    parallel = args.llamacpp_parallel or args.max_concurrency or len(work.requests)
    gguf = Path(args.llamacpp_model) if args.llamacpp_model else None
    server = LlamaServer(
        args.compare_llamacpp, gguf, ctx=llamacpp_context(work, parallel), parallel=parallel, threads=args.llamacpp_threads
    )
    print(f"starting llama-server ({args.compare_llamacpp}, -np {parallel}); log: {server.log_path}")
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    try:
        server.start()  # blocks the loop while llama-server loads: nothing else is running
        for i in range(max(1, args.compare_rounds)):
            if i > 0:
                work = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + i}), work.tokenizer)
                sluice, _ = await bench_server(args, args.base_url, args.backend, work, flush=not args.no_flush_cache,
                                               title=f" sluice, round {i + 1} ")
            # No /flush_cache there; the warm-up prompts share no prefix with the dataset.
            llama, _ = await bench_server(args, server.base_url, LLAMACPP_BACKEND[args.backend], work, flush=False,
                                          title=" llama.cpp " if i == 0 else f" llama.cpp, round {i + 1} ")
            llama["llamacpp_command"] = server.cmd
            pairs.append((sluice, llama))
    finally:
        server.stop()
    ratios = [s["output_throughput"] / l["output_throughput"] if l["output_throughput"] > 0 else 0.0 for s, l in pairs]
    print(format_comparison(median_record([s for s, _ in pairs]), median_record([l for _, l in pairs]), ratios))
    records = [{"engine": engine, "round": i, **r} for i, pair in enumerate(pairs) for engine, r in zip(("sluice", "llama.cpp"), pair)]
    save_records(args.output_file, "serving", records, args)
    return records
