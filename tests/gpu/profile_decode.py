"""Does the GPU idle between decode steps? A torch-profiler summary, on one NVIDIA GPU:

    python tests/gpu/profile_decode.py --json out.json          # overlap on, then off

Not a test (pytest does not collect it). A dummy-weight Llama-3.2-1B shape decodes
`--batch` requests at once (all admitted before the window opens). A first run,
unprofiled, measures how long the whole generate takes; the second run is profiled
(CUDA activity through CUPTI, process-wide, so the engine's worker thread and its
stream are included) from 40% to 70% of that time, which is steady-state decode.
From the trace's device events (kernels, memcpys, memsets) it reports:

- busy_pct: the union of device-event intervals over the window, in percent;
- idle gaps between consecutive device events: count over 20 µs, their total, the largest;
- decode steps in the window (tokens generated / batch), and ms per step.

With overlap scheduling on, the scheduler's work for step N+1 (batch bookkeeping,
sampling results, output processing) runs while step N is on the GPU, so busy_pct
should be close to 100 and no gap should be step-sized; `--disable-overlap` shows
what the host costs when it is not hidden.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu import write_model_dir  # noqa: E402
from tests.gpu.roofline import MODELS  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_intervals(trace_path: Path, lo_us: float, hi_us: float) -> list[tuple[float, float]]:
    """(start, end) in µs of every device event inside [lo, hi], sorted."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    out = []
    for e in events:
        if e.get("cat") in DEVICE_CATS and "dur" in e:
            s, d = float(e["ts"]), float(e["dur"])
            if s >= lo_us and s + d <= hi_us:
                out.append((s, s + d))
    return sorted(out)


def summarize(intervals: list[tuple[float, float]], gap_us: float = 20.0) -> dict[str, Any]:
    busy, gaps = 0.0, []
    cur_s, cur_e = intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = intervals[-1][1] - intervals[0][0]
    big = [g for g in gaps if g > gap_us]
    return {
        "window_ms": round(span / 1e3, 2),
        "busy_pct": round(100 * busy / span, 1),
        "device_events": len(intervals),
        f"gaps_over_{int(gap_us)}us": len(big),
        "gaps_over_total_ms": round(sum(big) / 1e3, 3),
        "largest_gap_us": round(max(gaps, default=0.0), 1),
        "median_gap_us": round(sorted(gaps)[len(gaps) // 2], 2) if gaps else 0.0,
    }


def run(args: argparse.Namespace, overlap: bool, model_dir: Path) -> dict[str, Any]:
    from runtime import Engine

    engine = Engine(
        model_path=str(model_dir), load_format="dummy", device="cuda", dtype="bfloat16", random_seed=0,
        context_length=2048, max_running_requests=args.batch, disable_radix_cache=True,
        disable_overlap_schedule=not overlap, cuda_graph_max_bs=args.batch,
    )  # fmt: skip
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 49152, (args.input_len,), generator=gen).tolist() for _ in range(args.batch)]
        params = dict(temperature=0.0, ignore_eos=True, max_new_tokens=args.output_len)
        engine.generate(prompts[:8], dict(params, max_new_tokens=16))  # warm-up
        start = time.perf_counter()
        engine.generate(prompts, params)
        total = time.perf_counter() - start

        done = threading.Event()
        worker = threading.Thread(target=lambda: (engine.generate(prompts, params), done.set()))
        worker.start()
        time.sleep(0.4 * total)
        activities = [torch.profiler.ProfilerActivity.CUDA]  # device events only: CPU tracing would slow the host it measures
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            time.sleep(0.3 * total)
            t1 = time.perf_counter()
        worker.join()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            intervals = device_intervals(path, 0.0, float("inf"))
        summary = summarize(intervals)
        steps = (t1 - t0) / (total / args.output_len)  # decode steps the window spans, at the run's mean pace
        return {
            "overlap": overlap,
            "batch": args.batch,
            "generate_s": round(total, 2),
            "output_tok_s": round(args.batch * args.output_len / total, 1),
            "ms_per_step_mean": round(1e3 * total / args.output_len, 2),
            "steps_in_window": round(steps, 1),
            **summary,
        }
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--disable-overlap", action="store_true", help="Only the overlap-off run.")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_decode.py needs an NVIDIA GPU")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / args.model, **MODELS[args.model])
        for overlap in ([False] if args.disable_overlap else [True, False]):
            row = run(args, overlap, model_dir)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
