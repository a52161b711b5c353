"""`sluice bench all-reduce`: the collectives of a tensor-parallel step, measured.

1. Latency of one all-reduce per message size over a group of --tp-size ranks on this
   machine: through sluice's tensor_model_parallel_all_reduce (shared memory on CPU,
   runtime/distributed/shm_comm.py; gloo with --disable-custom-all-reduce) and through
   torch.distributed.all_reduce directly (gloo), interleaved on the same ranks.
2. With --model-path (or the default model / --load-format dummy): the share of a
   tensor-parallel decode step that rank 0 spends in collectives, from torch.profiler
   (time inside shm / gloo all-reduce, all-gather and broadcast ops over the forward's time).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Any

from bench.engine_runs import add_engine_arguments, close_engine, engine_settings, make_engine
from bench.metrics import save_records

# torch.profiler's events for one collective as the calling rank sees it (its wait for
# the other ranks included): "shm:all_reduce", "gloo:all_reduce", "gloo:broadcast", ...
COLLECTIVE_PREFIXES = ("shm:", "gloo:", "nccl:")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", default=[576, 576 * 8, 576 * 64, 576 * 512], help="float32 elements per message.")
    parser.add_argument("--iters", type=int, default=200, help="All-reduces timed per size and variant.")
    parser.add_argument("--decode-steps", type=int, default=32, help="Decode steps profiled for the step share (0 = skip).")
    parser.add_argument("--batch-size", type=int, default=1, help="Requests decoding together in the profiled steps.")
    parser.add_argument("--output-file", default=None, help="Append the results as JSON lines.")
    add_engine_arguments(parser)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, size: int, port: int, sizes: list[int], iters: int, shm: bool, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from runtime.distributed.parallel_state import init_tensor_parallel, tensor_model_parallel_all_reduce

    torch.set_num_threads(1)
    init_tensor_parallel(rank, size, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60.0, shm=shm)
    results = []
    for n in sizes:
        x = torch.ones(n)
        variants = {"sluice": lambda: tensor_model_parallel_all_reduce(x), "torch.distributed": lambda: dist.all_reduce(x)}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(10):
            for fn in variants.values():
                fn()
        for _ in range(iters):
            for name, fn in variants.items():  # interleaved: both see the same machine noise
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        results.append({"elements": n, "bytes": 4 * n, **{f"{k}_median_us": statistics.median(v) * 1e6 for k, v in times.items()}})
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def measure_all_reduce(size: int, sizes: list[int], iters: int, shm: bool = True) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, sizes, iters, shm, queue)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        results: list[dict[str, Any]] = queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results


def measure_step_share(args: argparse.Namespace) -> dict[str, Any]:
    """Profile rank 0's forwards during `decode_steps` decode steps at --tp-size."""
    from torch.profiler import ProfilerActivity, profile

    settings = engine_settings(args, max_running_requests=max(args.batch_size, 1), max_total_tokens=8192, chunked_prefill_size=-1)
    engine = make_engine(settings)
    try:
        params = {"max_new_tokens": args.decode_steps, "temperature": 0.0, "ignore_eos": True}
        prompts = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(args.batch_size)]
        engine.generate(prompts, {**params, "max_new_tokens": 2})  # warm-up
        # The profiler records the thread that starts it: start it on the worker
        # executor's one thread, where every forward (and its collectives) runs.
        prof = profile(activities=[ProfilerActivity.CPU])
        worker_thread = engine.scheduler_loop.executor
        worker_thread.submit(prof.__enter__).result()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        wall = time.perf_counter() - t0
        worker_thread.submit(prof.__exit__, None, None, None).result()
        events = prof.key_averages()
        comm_us = sum(e.cpu_time_total for e in events if e.key.startswith(COLLECTIVE_PREFIXES))
        matmul_us = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm"))
    finally:
        close_engine(engine)
    return {
        "tp_size": settings.tp_size,
        "batch_size": args.batch_size,
        "decode_steps": args.decode_steps,
        "wall_s": wall,
        "collective_s": comm_us / 1e6,
        "collective_share_of_wall": comm_us / 1e6 / wall,
        "matmul_s": matmul_us / 1e6,
    }


def main(args: argparse.Namespace) -> int:
    size = max(args.tp_size, 2)
    print(__doc__.split("\n\n", 1)[1].strip())
    shm = not getattr(args, "disable_custom_all_reduce", False)
    records: list[dict[str, Any]] = measure_all_reduce(size, args.sizes, args.iters, shm)
    path = "shared memory" if shm else "gloo"
    print(f"\nAll-reduce over {size} ranks on this machine (sluice: {path}; torch.distributed: gloo), median of {args.iters}:")
    print(f"{'elements':>10} {'bytes':>10} {'sluice us':>10} {'torch.distributed us':>21}")
    for r in records:
        print(f"{r['elements']:>10} {r['bytes']:>10} {r['sluice_median_us']:>10.1f} {r['torch.distributed_median_us']:>21.1f}")
    if args.decode_steps > 0 and args.tp_size > 1:
        share = measure_step_share(args)
        records.append(share)
        print(
            f"\nDecode at tp_size {share['tp_size']}, batch {share['batch_size']}: {share['decode_steps']} steps in "
            f"{share['wall_s']:.3f} s; rank 0 in collectives {share['collective_s']:.3f} s "
            f"({100 * share['collective_share_of_wall']:.1f}% of the wall time), in matmuls {share['matmul_s']:.3f} s"
        )
    save_records(args.output_file, "all-reduce", records, args)
    return 0
