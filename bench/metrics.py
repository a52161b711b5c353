"""Per-request timings -> the metrics and the report block of SGLang's bench_serving.

Definitions (every time is measured on the client, in seconds, ms in the report):
- TTFT: request sent -> first chunk that carries new output.
- ITL: every gap between consecutive chunks that carry new output.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), for requests with > 1 output token.
- E2E: request sent -> last byte of the response.
Output token counts are the server's (usage / meta_info), never chunk counts.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WIDTH = 50


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # prompt tokens the server counted (or what was sent)
    output_len: int = 0  # completion tokens the server counted
    expected_output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    error: str = ""


def _stats(values: list[float], prefix: str, percentiles: tuple[int, ...] = (99,)) -> dict[str, float]:
    import numpy as np

    arr = np.asarray(values, dtype=np.float64) * 1000.0 if values else np.zeros(1)
    out = {
        f"mean_{prefix}_ms": float(arr.mean()),
        f"median_{prefix}_ms": float(np.median(arr)),
        f"std_{prefix}_ms": float(arr.std()),
    }
    for p in percentiles:
        out[f"p{p}_{prefix}_ms"] = float(np.percentile(arr, p))
    out[f"max_{prefix}_ms"] = float(arr.max())
    return out


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    duration = max(duration, 1e-9)
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "output_len_mismatches": sum(1 for r in ok if r.expected_output_len and r.output_len != r.expected_output_len),
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(r.latency for r in ok) / duration,
    }
    m |= _stats([r.ttft for r in ok], "ttft")
    m |= _stats(tpots, "tpot")
    m |= _stats(itls, "itl", (95, 99))
    m |= _stats([r.latency for r in ok], "e2e", (99,))
    m["errors"] = sorted({r.error for r in results if not r.success})[:5]
    return m


def row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value!s:<10}"


def rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{WIDTH}}"


def throughput_rows(m: dict[str, Any]) -> list[str]:
    """The rows every report opens with: counts, duration and throughputs."""
    return [
        row("Successful requests:", m["completed"]),
        row("Benchmark duration (s):", m["duration_s"]),
        row("Total input tokens:", m["total_input_tokens"]),
        row("Total generated tokens:", m["total_output_tokens"]),
        row("Request throughput (req/s):", m["request_throughput"]),
        row("Input token throughput (tok/s):", m["input_throughput"]),
        row("Output token throughput (tok/s):", m["output_throughput"]),
        row("Total token throughput (tok/s):", m["total_throughput"]),
    ]


_STAT_LABELS = {"mean": "Mean", "median": "Median", "p95": "P95", "p99": "P99", "max": "Max"}


def _latency_rows(m: dict[str, Any], title: str, key: str, label: str, stats: tuple[str, ...] = ("mean", "median", "p99")) -> list[str]:
    return [rule(title, "-")] + [row(f"{_STAT_LABELS[st]} {label} (ms):", m[f"{st}_{key}_ms"]) for st in stats]


def format_report(m: dict[str, Any], header: list[tuple[str, Any]], title: str = " Serving Benchmark Result ") -> str:
    lines = [rule(title, "=")]
    lines += [row(label, value) for label, value in header]
    lines += throughput_rows(m)
    lines.append(row("Concurrency:", m["concurrency"]))
    lines += _latency_rows(m, "Time to First Token", "ttft", "TTFT")
    lines += _latency_rows(m, "Time per Output Token (excl. 1st token)", "tpot", "TPOT")
    lines += _latency_rows(m, "Inter-token Latency", "itl", "ITL", ("mean", "median", "p95", "p99", "max"))
    lines += _latency_rows(m, "End-to-end Latency", "e2e", "E2E Latency")
    lines += [
        rule("", "-"),
        row("Failed requests:", m["failed"]),
        row("Cached prompt tokens:", m["total_cached_tokens"]),
        row("Output length mismatches:", m["output_len_mismatches"]),
    ]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """CPU model and core count (from lscpu where there is one), torch threads, date."""
    import torch

    model = platform.processor() or platform.machine()
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in text.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1_5_15": list(os.getloadavg()),  # other work on the machine skews absolute numbers
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def save_records(path: str | None, tool: str, records: list[dict[str, Any]], args: Any) -> None:
    """Append one line per record, tagged with the tool, the machine and the args (no-op without a path)."""
    if not path:
        return
    machine = machine_info()
    for r in records:
        append_jsonl(path, {"tool": tool, **r, "machine": machine, "args": vars(args)})


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """One line per run: every metric plus the args that produced it."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(jsonable(record)) + "\n")
