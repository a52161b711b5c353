"""`sluice bench scheduler-overhead`: the real Scheduler with a forward that costs nothing.

A stub worker (runtime/model_executor/stub_worker.py) answers every forward at once with one token per request, so what
is timed is the scheduler's own CPU work per decode round: get_next_batch_to_run
(merging, PrefillAdder checks, check_decode_mem, prepare_for_decode), the
ModelWorkerBatch snapshot (sampling tensors, future ids), and
process_batch_result (append, stop checks, incremental detokenizing, emitting).
Rounds run back to back as with --disable-overlap-schedule (overlap only changes
what runs concurrently, not the scheduler's work). Pools are built as
runtime/engine_setup.py builds them, without a KV tensor (the stub never reads it).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import random
import statistics
import time
from typing import Any

from bench.engine_runs import add_engine_arguments, engine_settings
from bench.metrics import save_records

STUB_TOKEN = 1000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-running", type=int, nargs="+", default=[1, 64, 256, 1024], help="Running requests N.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    parser.add_argument("--rounds", type=int, default=200, help="Decode rounds timed per N.")
    parser.add_argument("--warmup-rounds", type=int, default=10, help="Decode rounds run untimed first.")
    parser.add_argument("--no-detokenize", action="store_true", help="Skip the per-token detokenizer/output step.")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer dir (default: the default model's).")
    parser.add_argument("--profile", type=int, default=None, metavar="N", help="cProfile the timed rounds at this N.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the random prompts.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per N.")
    add_engine_arguments(parser)


def build_scheduler(settings: Any, context_len: int, tokenizer: Any) -> Any:
    """The real Scheduler and pools (as engine_setup builds them) over a StubWorker
    that answers STUB_TOKEN at once and keeps no KV."""
    from runtime.managers.scheduler import Scheduler
    from runtime.managers.scheduler_output import OutputProcessor
    from runtime.mem.pools import MemoryPools
    from runtime.model_executor.stub_worker import StubWorker

    pools = MemoryPools.build(
        settings.max_running_requests, context_len, settings.max_total_tokens, settings.page_size, settings.disable_radix_cache
    )
    worker = StubWorker(pools.num_rows, context_len, 0, len(tokenizer), constant_token=STUB_TOKEN)
    return Scheduler(settings, pools, worker, OutputProcessor(tokenizer))


def one_round(sched: Any) -> str | None:
    """What the event loop does for one batch, without the executor hop."""
    batch = sched.get_next_batch_to_run()
    if batch is not None:
        mwb = batch.get_model_worker_batch(sched.futures)
        snapshot = batch.copy_for_result()
        sched.process_batch_result(snapshot, sched.worker.forward(mwb))
    sched.last_batch = batch
    return None if batch is None else batch.forward_mode.name


def measure(args: argparse.Namespace, n: int, tokenizer: Any) -> dict[str, Any]:
    from runtime.managers.req import Req
    from runtime.sampling_params import SamplingParams

    max_new = args.warmup_rounds + args.rounds + 64
    per_req = args.input_len + max_new
    page = engine_settings(args).page_size
    total = (n * (per_req + 2 * page) // page + 1) * page
    settings = engine_settings(args, device="cpu", random_seed=0)
    settings = dataclasses.replace(settings, max_running_requests=max(n, settings.max_running_requests or 0), max_total_tokens=total)
    sched = build_scheduler(settings, per_req + page, tokenizer)
    rng = random.Random(args.seed)
    params = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True})
    for i in range(n):
        req = Req(f"r{i}", [rng.randrange(17, 49152) for _ in range(args.input_len)], params, (2,))
        if not args.no_detokenize:
            sched.output.register(req, lambda chunk: None, True)
        sched.add_request(req)
    mode = None
    while sched.waiting_queue or sched.chunked_req is not None or mode != "DECODE":
        mode = one_round(sched)
    assert sched.running_batch.batch_size() == n, (sched.running_batch.batch_size(), n)
    for _ in range(args.warmup_rounds):
        one_round(sched)

    profiler = cProfile.Profile() if args.profile == n else None
    wall, cpu = [], []
    if profiler:
        profiler.enable()
    for _ in range(args.rounds):
        w0, c0 = time.perf_counter(), time.process_time()
        mode = one_round(sched)
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
        assert mode == "DECODE"
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    assert sched.running_batch.batch_size() == n
    med = statistics.median(wall)
    return {
        "num_running": n,
        "rounds": args.rounds,
        "mean_us_per_round": statistics.fmean(wall) * 1e6,
        "median_us_per_round": med * 1e6,
        "p99_us_per_round": sorted(wall)[int(0.99 * (len(wall) - 1))] * 1e6,
        "median_us_per_request": med * 1e6 / n,
        "mean_cpu_us_per_round": statistics.fmean(cpu) * 1e6,
        "detokenize": not args.no_detokenize,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from runtime.model_executor.model_loader import prepare_model_dir

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or str(prepare_model_dir(None, "auto")))
    print(__doc__.split("\n\n", 1)[1].strip())
    header = f"{'N running':>10} {'mean us/round':>14} {'median us/round':>16} {'p99 us/round':>13} {'us/req (median)':>16} {'CPU us/round':>13}"
    records = [measure(args, n, tokenizer) for n in args.num_running]
    print(header)
    for r in records:
        print(
            f"{r['num_running']:>10} {r['mean_us_per_round']:>14.1f} {r['median_us_per_round']:>16.1f} "
            f"{r['p99_us_per_round']:>13.1f} {r['median_us_per_request']:>16.2f} {r['mean_cpu_us_per_round']:>13.1f}"
        )
    save_records(args.output_file, "scheduler-overhead", records, args)
    return records


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
