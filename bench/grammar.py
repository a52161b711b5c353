"""`sluice bench grammar`: what structured output costs (issue #14's measurements).

Throughput. `--concurrency` (32) requests of the random dataset run at once through the
in-process Engine, first each with a JSON-schema grammar (sampled at `--temperature`,
ended by the grammar or `--max-tokens`), then the same prompts without one, each
forced (`ignore_eos`) to exactly the number of tokens its constrained twin produced:
both arms decode the same tokens per request, so the ratio of their durations is the
grammar's cost (bitmask fill, mask application, matcher advance). The arms alternate
`--repeats` times; medians are reported.

Compile time. `--schemas` distinct JSON schemas compiled through the server's
GrammarBackend cold (a fresh backend, xgrammar's tokenizer info built first and not
counted), then again (the compiled-grammar cache): median and max ms per schema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.datasets import add_dataset_arguments, build_requests
from bench.engine_runs import add_engine_arguments, close_engine, engine_settings, make_engine, warm_up
from bench.metrics import machine_info, save_records

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "kind": {"enum": ["person", "robot", "cat"]},
    },
    "required": ["name", "age", "tags", "address", "kind"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=32, help="Requests decoded together.")
    parser.add_argument("--max-tokens", type=int, default=160, help="Cap on each constrained output.")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--repeats", type=int, default=3, help="Alternating constrained/unconstrained runs.")
    parser.add_argument("--schemas", type=int, default=20, help="Distinct schemas for the compile-time part.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line with every figure.")
    add_dataset_arguments(parser)
    add_engine_arguments(parser)


def distinct_schema(i: int) -> str:
    """SCHEMA with a field renamed and a bound changed per i: a different grammar each."""
    s = json.loads(json.dumps(SCHEMA))
    s["properties"][f"field_{i}"] = {"type": "string", "maxLength": 5 + i}
    s["properties"]["age"]["maximum"] = 100 + i
    return json.dumps(s)


def compile_times(engine: Any, n: int) -> dict[str, float]:
    from runtime.constrained import GrammarBackend

    backend = GrammarBackend(engine.tokenizer, engine.model_config.vocab_size)
    try:
        backend.compile(("regex", "a")).result()  # builds xgrammar's tokenizer info: not counted
        keys = [("json_schema", distinct_schema(i)) for i in range(n)]
        cold, warm = [], []
        for key in keys:
            t = time.perf_counter()
            backend.compile(key).result()
            cold.append(1e3 * (time.perf_counter() - t))
        for key in keys:
            t = time.perf_counter()
            backend.compile(key).result()
            warm.append(1e3 * (time.perf_counter() - t))
    finally:
        backend.close()
    return {
        "compile_cold_median_ms": round(statistics.median(cold), 2),
        "compile_cold_max_ms": round(max(cold), 2),
        "compile_cached_median_ms": round(statistics.median(warm), 4),
        "compile_cached_max_ms": round(max(warm), 4),
    }


def main(args: argparse.Namespace) -> int:
    args.num_prompts = args.concurrency
    settings = engine_settings(args, grammar_backend="xgrammar", max_running_requests=max(args.concurrency, 32))
    engine = make_engine(settings)
    try:
        requests = build_requests(args, engine.tokenizer, engine.model_config.vocab_size)
        prompts = [r.prompt_ids for r in requests]
        schema = json.dumps(SCHEMA)
        constrained = [
            {"json_schema": schema, "max_new_tokens": args.max_tokens, "temperature": args.temperature, "seed": i}
            for i in range(len(prompts))
        ]
        warm_up(engine, requests[:2])
        engine.generate(prompts[:2], constrained[:2])  # compiles SCHEMA: the cache is warm for every timed run
        timings: dict[str, list[float]] = {"grammar": [], "none": []}
        tokens: list[int] = []
        valid = total = 0
        for _ in range(args.repeats):
            t = time.perf_counter()
            outs = engine.generate(prompts, constrained)
            timings["grammar"].append(time.perf_counter() - t)
            lens = [len(o["output_ids"]) for o in outs]
            tokens.append(sum(lens))
            for o in outs:
                total += 1
                try:
                    json.loads(o["text"])
                    valid += 1
                except ValueError:
                    pass
            plain = [
                {"max_new_tokens": n, "temperature": args.temperature, "seed": i, "ignore_eos": True} for i, n in enumerate(lens)
            ]
            t = time.perf_counter()
            engine.generate(prompts, plain)
            timings["none"].append(time.perf_counter() - t)
        # Each repeat's two arms decode the same tokens; compare them pairwise.
        ratios = [none_s / grammar_s for grammar_s, none_s in zip(timings["grammar"], timings["none"])]
        record: dict[str, Any] = {
            "concurrency": args.concurrency,
            "output_tokens_per_run": tokens,
            "grammar_s": [round(x, 3) for x in timings["grammar"]],
            "none_s": [round(x, 3) for x in timings["none"]],
            "grammar_tok_s": round(statistics.median(t / s for t, s in zip(tokens, timings["grammar"])), 1),
            "none_tok_s": round(statistics.median(t / s for t, s in zip(tokens, timings["none"])), 1),
            "grammar_pct_of_none": round(100 * statistics.median(ratios), 1),
            "valid_json": f"{valid}/{total}",
            **compile_times(engine, args.schemas),
        }
    finally:
        close_engine(engine)
    print(json.dumps({**record, "machine": machine_info()}, indent=1))
    save_records(args.output_file, "grammar", [record], args)
    return 0
