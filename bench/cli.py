"""`sluice bench <tool>`: registered into the `sluice` command by app/cli.py.

app/cli.py calls `register(subparsers)` while building its parser on every
invocation (`sluice serve` included), so this module and the tool modules'
top levels import nothing heavy (no torch, no transformers, no aiohttp); each
tool imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

# name -> (module, help line)
TOOLS: dict[str, tuple[str, str]] = {
    "serving": ("bench.serving", "HTTP client against a running server: TTFT, TPOT, ITL, E2E, throughput."),
    "offline": ("bench.offline", "The datasets through the in-process Engine (optionally vs HF transformers)."),
    "one-batch": ("bench.one_batch", "One static batch: prefill latency, decode step latency."),
    "quant-linear": ("bench.quant_linear", "Weight-only int8/int4 linear (--quantization) vs fp32/bf16 F.linear per call."),
    "quant-model": ("bench.quant_model", "Quantization modes on the real model: load time, teacher-forced agreement with float32."),
    "gguf-q8-linear": ("bench.gguf_q8_linear", "A Q8_0 GGUF linear as two int4 planes vs int8 per channel and bf16."),
    "grammar": ("bench.grammar", "Structured output: decode throughput with vs without a JSON-schema grammar; compile time."),
    "kv-transfer": ("bench.kv_transfer", "Prefill/decode KV transfer over loopback: tcp and gloo backends vs a plain socket copy."),
    "all-reduce": ("bench.all_reduce", "Tensor-parallel collectives: all-reduce latency, and their share of a decode step."),
    "scheduler-overhead": ("bench.scheduler_overhead", "The real Scheduler with a stub forward: CPU time per round."),
    "chunked-itl": ("bench.chunked_itl", "Inter-token latency of running streams while a long prompt arrives."),
    "decode-attention": ("bench.decode_attention", "One decode step's attention: CPU kernel (fp32/bf16 KV) vs torch."),
    "decode-step": ("bench.decode_step", "One decode step's forward: eager torch vs fused C++ kernels vs torch.compile."),
    "deterministic": ("bench.deterministic", "Temperature-0 completions alone vs in 5 batch compositions: how many differ."),
    "multi-turn": ("bench.multi_turn", "Conversations whose turns repeat the earlier prompt and answer: TTFT and cache hits per turn."),
    "embeddings": ("bench.embeddings", "Embeddings per second of an --is-embedding engine (or server) at batch sizes 1 and 64."),
}


def _runner(module: str) -> Callable[[argparse.Namespace], int]:
    def run(ns: argparse.Namespace) -> int:
        return int(importlib.import_module(module).main(ns) or 0)

    run.__name__ = f"run_{module.rsplit('.', 1)[1]}"
    return run


def _arguments(module: str) -> Callable[[argparse.ArgumentParser], None]:
    add: Callable[[argparse.ArgumentParser], None] = importlib.import_module(module).add_arguments
    return add


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench` with one sub-subcommand per tool; each sets `func=` (Namespace -> exit code)."""
    bench = subparsers.add_parser("bench", help="Benchmarks: " + ", ".join(TOOLS) + ".")
    tools = bench.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(TOOLS) + "}")
    for name, (module, help_line) in TOOLS.items():
        p = tools.add_parser(name, help=help_line, description=help_line)
        _arguments(module)(p)
        p.set_defaults(func=_runner(module))
    return bench


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.cli <tool> ...` without the app package."""
    parser = argparse.ArgumentParser(prog="sluice")
    register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
