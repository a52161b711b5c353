"""`sluice bench chunked-itl`: do running streams keep streaming while a long prompt arrives?

Scenario: `--num-streams` requests decode (streamed); once every stream has
`--long-after-tokens` tokens, one `--long-input-len`-token prompt is submitted.
Reported per variant: the inter-token latency of the streams over their whole
life (median, p99, max, p99/median), the gaps that overlap the long prompt's
prefill (from its submission to its first token), and the long prompt's TTFT.
Variants (`--chunk-sizes`, then each `--ab`) run one after another in this
process on the same prompts, each on a fresh engine after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any

from bench.datasets import BenchRequest, TokenSampler
from bench.engine_runs import (
    add_engine_arguments,
    close_engine,
    engine_settings,
    greedy_params,
    make_engine,
    variant_settings,
    warm_up,
)
from bench.metrics import rule, save_records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[512, -1], help="chunked_prefill_size per variant.")
    parser.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]", help="Extra variant over the flags. Repeatable.")
    parser.add_argument("--num-streams", type=int, default=16, help="Streams decoding when the long prompt arrives.")
    parser.add_argument("--stream-input-len", type=int, default=128, help="Prompt tokens of each stream.")
    parser.add_argument("--stream-output-len", type=int, default=256, help="Output tokens of each stream.")
    parser.add_argument("--long-input-len", type=int, default=6000, help="Tokens of the long prompt.")
    parser.add_argument("--long-output-len", type=int, default=8, help="Output tokens of the long prompt.")
    parser.add_argument("--long-after-tokens", type=int, default=32, help="Submit the long prompt once every stream has this many tokens.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the random prompts.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per variant.")
    add_engine_arguments(parser)


@dataclass(slots=True)
class Trace:
    arrivals: list[float] = field(default_factory=list)  # perf_counter of each chunk with new tokens
    output_len: int = 0
    error: str = ""


async def _follow(engine: Any, req: BenchRequest, trace: Trace, progress: list[int], i: int, ready: asyncio.Event, need: int) -> None:
    seen = 0
    try:
        async for chunk in engine.async_generate_stream(req.prompt_ids, greedy_params(req)):
            n = chunk["meta_info"]["completion_tokens"]
            if n > seen:
                seen = n
                trace.arrivals.append(time.perf_counter())
                progress[i] = n
                if min(progress) >= need:
                    ready.set()
        trace.output_len = seen
    except Exception as exc:  # noqa: BLE001 - reported in the result
        trace.error = f"{type(exc).__name__}: {exc}"[:200]
        ready.set()


async def scenario(engine: Any, streams: list[BenchRequest], long_req: BenchRequest, after: int) -> dict[str, Any]:
    ready = asyncio.Event()
    progress = [0] * len(streams)
    traces = [Trace() for _ in streams]
    tasks = [asyncio.create_task(_follow(engine, r, t, progress, i, ready, after)) for i, (r, t) in enumerate(zip(streams, traces))]
    await ready.wait()
    long_trace = Trace()
    submitted = time.perf_counter()
    await _follow(engine, long_req, long_trace, [after], 0, asyncio.Event(), after)
    await asyncio.gather(*tasks)
    import numpy as np

    first_long = long_trace.arrivals[0] if long_trace.arrivals else float("nan")
    gaps, window = [], []
    for t in traces:
        for a, b in zip(t.arrivals, t.arrivals[1:]):
            gaps.append(b - a)
            if b > submitted and a < first_long:
                window.append(b - a)
    arr = np.asarray(gaps) * 1e3
    med, p99 = float(np.median(arr)), float(np.percentile(arr, 99))
    return {
        "failed": sum(1 for t in traces if t.error or t.output_len != streams[0].output_len) + int(bool(long_trace.error)),
        "num_gaps": len(gaps),
        "median_itl_ms": med,
        "p99_itl_ms": p99,
        "max_itl_ms": float(arr.max()),
        "p99_over_median": p99 / med,
        "window_gaps": len(window),
        "window_max_itl_ms": max(window) * 1e3 if window else float("nan"),
        "window_sum_ms": sum(window) * 1e3 / len(streams) if window else float("nan"),
        "long_ttft_ms": (first_long - submitted) * 1e3,
        "errors": sorted({t.error for t in [*traces, long_trace] if t.error})[:3],
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    need = args.long_input_len + args.long_output_len + args.num_streams * (args.stream_input_len + args.stream_output_len)
    base = engine_settings(args, max_total_tokens=max(2 * need, 32768))
    variants = [(f"chunked_prefill_size={cs}", dataclasses.replace(base, chunked_prefill_size=cs)) for cs in args.chunk_sizes]
    variants += [(spec, variant_settings(base, spec)) for spec in args.ab]
    print(__doc__.split("\n\n", 1)[1].strip())
    records = []
    data: tuple[list[BenchRequest], BenchRequest, list[BenchRequest]] | None = None
    for name, settings in variants:
        engine = make_engine(settings)
        try:
            if data is None:
                sampler = TokenSampler(engine.tokenizer, random.Random(args.seed), engine.model_config.vocab_size)
                streams = [BenchRequest(sampler.sample(args.stream_input_len), args.stream_output_len) for _ in range(args.num_streams)]
                long_req = BenchRequest(sampler.sample(args.long_input_len), args.long_output_len)
                warm = [BenchRequest(sampler.sample(args.long_input_len), 2), BenchRequest(sampler.sample(args.stream_input_len), 8)]
                data = (streams, long_req, warm)
            warm_up(engine, data[2])
            r = asyncio.run(scenario(engine, data[0], data[1], args.long_after_tokens))
            r |= {"variant": name, "settings": dataclasses.asdict(engine.settings), "dtype": str(engine.model_config.dtype).removeprefix("torch.")}
        finally:
            close_engine(engine)
        records.append(r)
        print(rule(f" {name} ", "-"))
        print(
            f"streams ITL: median {r['median_itl_ms']:.1f} ms, p99 {r['p99_itl_ms']:.1f} ms, max {r['max_itl_ms']:.1f} ms, "
            f"p99/median {r['p99_over_median']:.2f} ({r['num_gaps']} gaps, failed {r['failed']})"
        )
        print(
            f"during the long prefill: {r['window_gaps']} gaps, longest {r['window_max_itl_ms']:.1f} ms; "
            f"long prompt TTFT {r['long_ttft_ms']:.1f} ms"
        )
    print(rule(" Side by side ", "="))
    for r in records:
        print(f"{r['variant']:<52} p99/median ITL {r['p99_over_median']:6.2f}   max ITL {r['max_itl_ms']:8.1f} ms   long TTFT {r['long_ttft_ms']:8.1f} ms")
    save_records(args.output_file, "chunked-itl", records, args)
    return records


def main(args: argparse.Namespace) -> int:
    return 0 if all(r["failed"] == 0 for r in run(args)) else 1
