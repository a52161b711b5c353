"""`sluice bench offline`: the datasets through the in-process Engine, all at once.

Default: `Engine.generate(all prompts, all params)` (SGLang's bench_offline_throughput).
`--stream`: every request streamed concurrently instead, so TTFT/ITL are measured
as a client of the engine sees them. `--ab K=V,...` adds variants (settings
overrides) run one after another in this process on the same requests;
`--compare-hf` adds HF transformers `generate` on the same requests (compare_hf.py).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from bench.compare_hf import DTYPES, SORTS, greedy_agreement, run_hf, torch_dtype
from bench.datasets import BenchRequest, add_dataset_arguments, build_requests, warmup_requests
from bench.engine_runs import (
    add_engine_arguments,
    close_engine,
    engine_settings,
    generate_all,
    make_engine,
    stream_all,
    variant_settings,
    warm_up,
)
from bench.metrics import WIDTH, RequestResult, append_jsonl, compute_metrics, format_report, machine_info, row, rule, throughput_rows
from runtime.model_executor.resolve import resolve_device


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup-requests", type=int, default=1, help="Untimed requests run first (cache flushed after).")
    parser.add_argument("--stream", action="store_true", help="Stream every request and report TTFT/ITL too.")
    parser.add_argument(
        "--ab", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
        help="A variant: these settings over the flags (e.g. disable_overlap_schedule=true). Repeatable.",
    )
    parser.add_argument("--compare-hf", action="store_true", help="Also run HF transformers generate on the same requests.")
    parser.add_argument("--hf-dtype", choices=("same", *DTYPES), default="same", help="HF's dtype (same = sluice's).")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="HF generate batch size.")
    parser.add_argument("--hf-sort", choices=SORTS, default="output", help="How requests are ordered before HF batching.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per run.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    add_dataset_arguments(parser)
    add_engine_arguments(parser)


def results_from_outputs(requests: list[BenchRequest], outs: list[dict[str, Any]]) -> list[RequestResult]:
    """Engine-side timings (meta_info) of non-streamed outputs; no ITL."""
    results = []
    for req, out in zip(requests, outs):
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        results.append(RequestResult(
            success=reason == "length",
            prompt_len=meta["prompt_tokens"],
            output_len=meta["completion_tokens"],
            expected_output_len=req.output_len,
            ttft=meta.get("first_token_time") or 0.0,
            latency=meta.get("e2e_latency") or 0.0,
            cached_tokens=meta.get("cached_tokens") or 0,
            error="" if reason == "length" else f"finish_reason={reason}",
        ))
    return results


def format_offline(m: dict[str, Any], backend: str, title: str = " Offline Throughput Benchmark Result ") -> str:
    lines = [rule(title, "="), row("Backend:", backend), *throughput_rows(m)]
    if "median_ttft_ms" in m:
        lines += [
            row("Median TTFT, engine-side (ms):", m["median_ttft_ms"]),
            row("Median E2E, engine-side (ms):", m["median_e2e_ms"]),
            row("Failed requests:", m["failed"]),
            row("Output length mismatches:", m["output_len_mismatches"]),
        ]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _run_variant(name: str, settings: Any, args: argparse.Namespace, state: dict[str, Any]) -> dict[str, Any]:
    engine = make_engine(settings)
    try:
        if "requests" not in state:
            state["requests"] = build_requests(args, engine.tokenizer, engine.model_config.vocab_size)
            state["model_dir"] = engine.model_dir
            state["dtype"] = engine.model_config.dtype
            state["real_weights"] = settings.load_format != "dummy"
            state["device"] = resolve_device(engine.settings.device)
        requests: list[BenchRequest] = state["requests"]
        warm_up(engine, warmup_requests(engine.tokenizer, args.warmup_requests, requests, args.seed))
        dtype = str(engine.model_config.dtype).removeprefix("torch.")
        backend = f"sluice engine [{name}] ({dtype})"
        if args.stream:
            results, duration = stream_all(engine, requests)
            m = compute_metrics(results, duration)
            print(format_report(m, [("Backend:", backend), ("Traffic request rate:", "inf (all at once)")], " Offline (streamed) Result "))
            outputs = None
        else:
            outs, duration = generate_all(engine, requests)
            m = compute_metrics(results_from_outputs(requests, outs), duration)
            print(format_offline(m, backend))
            outputs = [o["output_ids"] for o in outs]
        record = {
            "tool": "offline", "variant": name, **m, "dtype": dtype,
            "settings": dataclasses.asdict(engine.settings), "server_info": engine.get_server_info(),
        }
        record["_outputs"] = outputs
        return record
    finally:
        close_engine(engine)


def _print_comparison(records: list[dict[str, Any]], stream: bool) -> None:
    base = records[0]["output_throughput"]
    print(rule(" Side by side (same requests, same process) ", "="))
    for r in records:
        extra = f"  median TTFT {r['median_ttft_ms']:.1f} ms" if stream and r["tool"] == "offline" else ""
        print(f"{r['variant']:<44} {r['output_throughput']:>9.2f} out tok/s  x{r['output_throughput'] / base:.3f}{extra}")
    print("=" * 50)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = engine_settings(args)
    variants = [("flags", base)] + [(spec, variant_settings(base, spec)) for spec in args.ab]
    state: dict[str, Any] = {}
    records = [_run_variant(name, settings, args, state) for name, settings in variants]
    if args.compare_hf:
        dtype = state["dtype"] if args.hf_dtype == "same" else torch_dtype(args.hf_dtype)
        hf = run_hf(
            state["model_dir"], state["requests"], dtype, batch_size=args.hf_batch_size, sort=args.hf_sort,
            real_weights=state["real_weights"], device=state["device"], progress=not args.disable_tqdm,
        )
        hf_outputs = hf.pop("outputs")
        backend = f"HF transformers generate ({hf['dtype']}, {hf['device']}, batch {hf['batch_size']}, left pad, sort={hf['sort']})"
        hf_m = {**hf, "completed": len(state["requests"]), "failed": 0}
        print(format_offline(hf_m, backend, " HF transformers Result "))
        hf_record = {"tool": "hf", "variant": backend, **hf_m}
        sluice = records[0]
        ratio = sluice["output_throughput"] / hf["output_throughput"]
        hf_record["sluice_over_hf_output_throughput"] = ratio
        if sluice["_outputs"] is not None and state["real_weights"] and hf["dtype"] == sluice["dtype"]:
            hf_record["greedy_agreement"] = greedy_agreement(sluice["_outputs"], hf_outputs)
        print(f"sluice output tok/s {sluice['output_throughput']:.2f} vs HF {hf['output_throughput']:.2f}: ratio {ratio:.2f}x")
        if "greedy_agreement" in hf_record:
            print(f"identical greedy outputs (sluice vs HF): {hf_record['greedy_agreement']:.1%} of requests")
        records.append(hf_record)
    if len(records) > 1:
        _print_comparison(records, args.stream)
    machine = machine_info()
    for r in records:
        r.pop("_outputs", None)
        if args.output_file:
            append_jsonl(args.output_file, {**r, "machine": machine, "args": vars(args)})
    return records


def main(args: argparse.Namespace) -> int:
    records = run(args)
    return 0 if all(r.get("failed", 0) == 0 and r.get("output_len_mismatches", 0) == 0 for r in records) else 1
