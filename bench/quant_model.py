"""Quantization modes on the real model: load time, and quality against float32.

For each mode (fp32, bf16, and int4 and gguf on a float32 or a bfloat16 model) this
times `load_model` on the prepared model directory, each in a fresh process (the
start-up cost after `sluice prepare`: the GGUF already converted, imports done, the
page cache warm; best and median of `--repeats` processes per mode, modes
interleaved), and runs held-out text teacher-forced, each window of up to
`--window` tokens in one prefill, against the float32 model: top-1 agreement (the
argmaxes equal) and the mean |delta logprob| of float32's choice. Decode step time
is `sluice bench one-batch ... --quantization MODE`'s.

    python -m bench.quant_model [--repeats 3] [--window 128] [--threads N] [--output-file F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

MODES = {  # name -> (model dtype, quantization); the quantized kernels take bf16 activations either way
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int4/fp32": ("float32", "int4"),
    "gguf/fp32": ("float32", "gguf"),
    "int4/bf16": ("bfloat16", "int4"),
    "gguf/bf16": ("bfloat16", "gguf"),
}

# Not used anywhere else in the tests or benches (~230 tokens).
HELD_OUT_TEXT = (
    "Glaciers form where more snow falls in winter than melts in summer. Over many years the snow is "
    "compressed into dense ice, which begins to flow downhill under its own weight, carving valleys and "
    "carrying rocks far from where they started. When the climate warms, a glacier retreats, leaving "
    "behind lakes, ridges of gravel and the polished bedrock it once covered. "
    "To bake a simple loaf of bread, mix flour, water, salt and a little yeast into a soft dough. Knead it "
    "for ten minutes, let it rise in a warm place until it doubles in size, shape it, and bake it in a hot "
    "oven until the crust is brown and the bottom sounds hollow when tapped. "
    "The printing press, developed in Europe in the fifteenth century, made books far cheaper to produce. "
    "Within a few decades, printed works spread across the continent, literacy rose, and new ideas in "
    "science, religion and politics reached readers who had never owned a book before. "
    "A good password is long, hard to guess and used for one account only; a password manager can "
    "remember them so that you do not have to."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="Timed loads (fresh processes) per mode.")
    parser.add_argument("--window", type=int, default=128, help="Tokens per teacher-forced window.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores).")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per mode.")
    parser.add_argument("--load-once", choices=list(MODES), default=None, help=argparse.SUPPRESS)  # the child process


def prefill_logits(model: Any, config: Any, ids: list[int]) -> Any:
    """float32 logits `[len(ids), vocab]` of one sequence in one extend forward."""
    import torch

    from kernels.attention.torch_native import TorchNativeBackend
    from runtime.mem.kv_pool import KVPool
    from runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

    n = len(ids)
    pool = KVPool(n + 1, config.num_layers, config.num_kv_heads, config.head_dim, config.dtype, "cpu")
    slots = torch.arange(1, n + 1)  # slot 0 is the pool's dummy slot
    lens = torch.tensor([n])
    backend = TorchNativeBackend()
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.tensor(ids), positions=torch.arange(n),
        out_cache_loc=slots, req_pool_indices=torch.tensor([0]), seq_lens=lens, extend_prefix_lens=torch.tensor([0]),
        extend_seq_lens=lens, seq_lens_cpu=[n], extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n],
        req_to_token=slots.to(torch.int32)[None], kv_pool=pool, attn_backend=backend,
    )  # fmt: skip
    backend.init_forward_metadata(fb)
    with torch.no_grad():
        return model.compute_logits(model(fb.input_ids, fb.positions, fb)).float()


def agreement(logits: Any, ref: Any) -> tuple[float, float]:
    """(top-1 agreement, mean |delta logprob| of ref's argmax)."""
    import torch

    choice = ref.argmax(-1)
    lp, ref_lp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
    delta = (lp.gather(-1, choice[:, None]) - ref_lp.gather(-1, choice[:, None])).abs()
    return (logits.argmax(-1) == choice).float().mean().item(), delta.mean().item()


def load_seconds(mode: str, threads: int | None) -> float:
    """`load_model` time of `mode` in a fresh process."""
    cmd = [sys.executable, "-m", "bench.quant_model", "--load-once", mode, *(["--threads", str(threads)] if threads else [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["seconds"])


def main(args: argparse.Namespace) -> int:
    import gguf  # noqa: F401  (imported before any clock starts, like every other module)
    import torch
    from transformers import AutoTokenizer

    from bench.metrics import save_records
    from runtime.model_config import ModelConfig
    from runtime.model_executor.model_loader import (
        gguf_source,
        load_model,
        prepare_model_dir,
    )
    from runtime.model_executor.weight_utils import open_gguf

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = prepare_model_dir(None, "auto")
    configs = {name: ModelConfig.from_pretrained(model_dir, getattr(torch, dtype), 512) for name, (dtype, _) in MODES.items()}

    def load(name: str) -> Any:
        return load_model(model_dir, configs[name], "auto", "cpu", None, MODES[name][1])  # type: ignore[arg-type]

    if args.load_once:
        start = time.perf_counter()
        load(args.load_once)
        print(json.dumps({"seconds": time.perf_counter() - start}))
        return 0
    load("gguf/bf16")  # warm the page cache: the GGUF and its conversion
    times: dict[str, list[float]] = {name: [] for name in MODES}
    for _ in range(args.repeats):
        for name in MODES:
            times[name].append(load_seconds(name, args.threads))
    source = gguf_source(model_dir)
    assert source is not None, "the embedded default model is a GGUF"
    start = time.perf_counter()
    open_gguf(source)
    header_s = time.perf_counter() - start

    ids = AutoTokenizer.from_pretrained(model_dir).encode(HELD_OUT_TEXT)
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    ref = torch.cat([prefill_logits(load("fp32"), configs["fp32"], w) for w in windows])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(ids)} held-out tokens in {len(windows)} windows")
    print(f"GGUF header parse (open_gguf): {header_s:.2f} s")
    print(f"{'mode':>9} {'load best s':>11} {'load median s':>13} {'top-1 agree':>11} {'mean |dlogp|':>12}")
    records = []
    for name in MODES:
        model = load(name)
        top1, dlogp = agreement(torch.cat([prefill_logits(model, configs[name], w) for w in windows]), ref)
        best, median = min(times[name]), statistics.median(times[name])
        print(f"{name:>9} {best:11.2f} {median:13.2f} {top1:11.4f} {dlogp:12.4f}")
        records.append({"mode": name, "load_best_s": best, "load_median_s": median, "top1": top1, "mean_abs_dlogprob": dlogp,
                        "tokens": len(ids), "gguf_header_s": header_s})  # fmt: skip
        del model
    save_records(args.output_file, "quant-model", records, args)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.quant_model", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
