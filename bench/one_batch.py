"""`sluice bench one-batch`: one static batch through the real Engine and ModelRunner.

Method: the batch is submitted at once with `Engine.generate` (every request is
queued before the scheduler's next round, so the batch is static), with the
knobs set so the whole batch is prefilled in one forward (no chunking, a
prefill budget of at least bs * input_len, max_running_requests >= bs) unless
you set them yourself. The ModelRunner's two step halves are wrapped to time every
forward on the worker thread (build ForwardBatch + model + sampling + the host
sync): prefill latency is the extend forward(s), decode latency the median decode
step of the full batch. "Engine" numbers add scheduling and
output processing: the batch's last first-token time (engine meta_info) and
(total - that) / (output_len - 1) per step. A warm-up batch of the same shape
runs first.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import threading
import time
from typing import Any

from bench.datasets import BenchRequest, TokenSampler
from bench.engine_runs import add_engine_arguments, close_engine, engine_settings, generate_all, make_engine, warm_up
from bench.metrics import save_records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1], help="Batch sizes to run.")
    parser.add_argument("--input-len", type=int, nargs="+", default=[256], help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, nargs="+", default=[32], help="Output tokens per request.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the random prompts.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per (bs, in, out).")
    add_engine_arguments(parser)


class ForwardTimer:
    """Wraps a host runner's two step halves (build_forward_batch, run_step); records
    (mode, bs, tokens, seconds) per forward, from the first's start to the second's end."""

    def __init__(self, runner: Any) -> None:
        self.records: list[tuple[str, int, int, float]] = []
        self._lock = threading.Lock()
        self._start = threading.local()
        build, run = runner.build_forward_batch, runner.run_step

        def timed_build(mwb: Any) -> Any:
            self._start.t = time.perf_counter()
            return build(mwb)

        def timed_run(fb: Any, mwb: Any) -> Any:
            out = run(fb, mwb)
            elapsed = time.perf_counter() - self._start.t
            with self._lock:
                self.records.append((mwb.forward_mode.name, len(mwb.req_pool_indices), int(sum(mwb.extend_seq_lens)), elapsed))
            return out

        runner.build_forward_batch = timed_build  # the runner looks both up per step
        runner.run_step = timed_run

    def take(self) -> list[tuple[str, int, int, float]]:
        with self._lock:
            out, self.records = self.records, []
        return out


def _batch(sampler: TokenSampler, bs: int, input_len: int, output_len: int) -> list[BenchRequest]:
    return [BenchRequest(sampler.sample(input_len), output_len) for _ in range(bs)]


def run_one(engine: Any, timer: ForwardTimer, sampler: TokenSampler, bs: int, input_len: int, output_len: int) -> dict[str, Any]:
    warm_up(engine, _batch(sampler, bs, input_len, min(output_len, 4)))
    timer.take()
    outs, total = generate_all(engine, _batch(sampler, bs, input_len, output_len))
    forwards = timer.take()
    metas = [o["meta_info"] for o in outs]
    failed = sum(1 for m in metas if m["completion_tokens"] != output_len)
    extends = [f for f in forwards if f[0] in ("EXTEND", "MIXED")]
    decodes = [f[3] for f in forwards if f[0] == "DECODE" and f[1] == bs]
    prefill_s = sum(f[3] for f in extends)
    last_first = max(m["first_token_time"] or 0.0 for m in metas)
    engine_step = (total - last_first) / (output_len - 1) if output_len > 1 else float("nan")
    med_decode = statistics.median(decodes) if decodes else float("nan")
    return {
        "batch_size": bs, "input_len": input_len, "output_len": output_len, "failed": failed,
        "prefill_forwards": len(extends),
        "prefill_latency_s": prefill_s,
        "prefill_throughput": bs * input_len / prefill_s if prefill_s else float("nan"),
        "engine_batch_ttft_s": last_first,
        "decode_steps": len(decodes),
        "decode_median_latency_s": med_decode,
        "decode_median_throughput": bs / med_decode,
        "engine_step_s": engine_step,
        "engine_decode_throughput": bs / engine_step,
        "total_latency_s": total,
        "total_throughput": bs * (input_len + output_len) / total,
    }


def print_result(r: dict[str, Any]) -> None:
    bs = r["batch_size"]
    print(f"== batch {bs} x input {r['input_len']} -> output {r['output_len']} (failed: {r['failed']})")
    print(
        f"Prefill. latency: {r['prefill_latency_s']:.5f} s, throughput: {r['prefill_throughput']:10.2f} token/s "
        f"({r['prefill_forwards']} forward(s), worker-side); engine: last first token after {r['engine_batch_ttft_s']:.5f} s"
    )
    print(
        f"Decode.  median latency: {r['decode_median_latency_s']:.5f} s, median throughput: "
        f"{r['decode_median_throughput']:10.2f} token/s ({r['decode_steps']} steps of batch {bs}, worker-side)"
    )
    print(
        f"Decode (engine). mean step: {r['engine_step_s']:.5f} s, "
        f"throughput: {r['engine_decode_throughput']:10.2f} token/s"
    )
    print(f"Total.   latency: {r['total_latency_s']:.5f} s, throughput: {r['total_throughput']:10.2f} token/s")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    biggest = max(args.batch_size) * max(args.input_len)
    longest = max(args.input_len) + max(args.output_len)
    settings = engine_settings(
        args,
        chunked_prefill_size=-1,
        max_prefill_tokens=max(biggest, 16384),
        max_running_requests=max(max(args.batch_size), 1),
        max_total_tokens=max(args.batch_size) * longest * 2 + 4096,
    )
    engine = make_engine(settings)
    print(__doc__.split("\n\n", 1)[1].strip())
    records = []
    try:
        timer = ForwardTimer(engine.worker)
        sampler = TokenSampler(engine.tokenizer, random.Random(args.seed), engine.model_config.vocab_size)
        dtype = str(engine.model_config.dtype).removeprefix("torch.")
        for bs, n_in, n_out in itertools.product(args.batch_size, args.input_len, args.output_len):
            r = run_one(engine, timer, sampler, bs, n_in, n_out)
            r["dtype"] = dtype
            print_result(r)
            records.append(r)
    finally:
        close_engine(engine)
    save_records(args.output_file, "one-batch", records, args)
    return records


def main(args: argparse.Namespace) -> int:
    return 0 if all(r["failed"] == 0 for r in run(args)) else 1
