"""Roofline check of the CUDA path, on one NVIDIA GPU, in one command:

    python tests/gpu/roofline.py                 # Llama-3.2-1B and Llama-3-8B shapes, dummy bf16 weights
    python tests/gpu/roofline.py --models 1b --disable-cuda-graph --json out.json

Not a test (pytest does not collect it). It measures the machine first, then the
engine through its public API (Engine.generate, so scheduling is included):

- HBM roofline: device-to-device copy bandwidth (bytes read + written per second).
  Batch-1 decode reads every weight once per token, so its ceiling is
  bandwidth / weight bytes read per token; reported as achieved tok/s and % of it.
- Compute roofline: bf16 matmul TFLOP/s (8192^3). Prefill of 8 x 2048 tokens is
  reported as tok/s and MFU = model FLOPs per second / that measured peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.gpu import write_model_dir  # noqa: E402

LLAMA3 = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5)
MODELS: dict[str, dict[str, Any]] = {
    "1b": dict(LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64, tie_word_embeddings=True),
    "8b": dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128, tie_word_embeddings=False),
}


def cuda_time(fn: Any, iters: int, warmup: int = 3) -> float:
    """Seconds per call of `fn`, by CUDA events."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), iters=20)

    return 2 * nbytes / seconds  # read + write


def matmul_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = cuda_time(lambda: a @ b, iters=20)
    return 2 * n**3 / seconds


def decode_bytes_per_token(model: torch.nn.Module, tied: bool) -> int:
    """Weight bytes one decode step reads: all of them, except that an untied input
    embedding is only gathered (one row), not read whole."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not tied:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def prefill_flops(cfg: dict[str, Any], model: torch.nn.Module, num_seqs: int, seq_len: int) -> float:
    """Matmul FLOPs of a prefill (2 per weight per token, lm_head on the last token of
    each sequence only) plus causal attention (QK^T and PV over half the square)."""
    emb = model.model.embed_tokens.weight.numel()
    body = sum(p.numel() for name, p in model.named_parameters() if "layers." in name and p.dim() == 2)
    attn = 2 * 2 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"] * seq_len * seq_len / 2
    return num_seqs * (2 * body * seq_len + 2 * emb + attn)


def measure(name: str, cfg: dict[str, Any], args: argparse.Namespace, bw: float, peak: float) -> dict[str, Any]:
    from runtime import Engine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / name, **cfg)
        engine = Engine(
            model_path=str(model_dir), load_format="dummy", device="cuda", dtype="bfloat16", random_seed=0,
            context_length=4096, chunked_prefill_size=16384, max_prefill_tokens=16384, disable_radix_cache=True,
            disable_cuda_graph=args.disable_cuda_graph, disable_overlap_schedule=args.disable_overlap,
        )  # fmt: skip
    try:
        model = engine.worker.model  # the ModelRunner at tp_size 1
        gen = torch.Generator().manual_seed(0)
        ids = lambda n: torch.randint(0, 49152, (n,), generator=gen).tolist()  # noqa: E731
        greedy = dict(temperature=0.0, ignore_eos=True)

        engine.generate(ids(16), dict(greedy, max_new_tokens=32))  # warm-up: JIT, allocator
        out = engine.generate(ids(16), dict(greedy, max_new_tokens=args.decode_tokens))
        meta = out["meta_info"]  # type: ignore[index]
        decode_tps = (args.decode_tokens - 1) / (meta["e2e_latency"] - meta["first_token_time"])
        ceiling = bw / decode_bytes_per_token(model, bool(cfg["tie_word_embeddings"]))

        prompts = lambda: [ids(args.prefill_len) for _ in range(args.prefill_seqs)]  # noqa: E731
        engine.generate(prompts(), dict(greedy, max_new_tokens=1))  # warm-up
        batch = prompts()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(batch, dict(greedy, max_new_tokens=1))
        seconds = time.perf_counter() - start
        flops = prefill_flops(cfg, model, args.prefill_seqs, args.prefill_len)
        return {
            "model": name,
            "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
            "cuda_graph": not args.disable_cuda_graph,
            "overlap": not args.disable_overlap,
            "decode_bs1_tok_s": round(decode_tps, 1),
            "decode_bs1_roofline_tok_s": round(ceiling, 1),
            "decode_bs1_pct_of_roofline": round(100 * decode_tps / ceiling, 1),
            "prefill_tok_s": round(args.prefill_seqs * args.prefill_len / seconds, 1),
            "prefill_mfu_pct": round(100 * flops / seconds / peak, 1),
        }
    finally:
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1b,8b", help="Comma-separated subset of: " + ", ".join(MODELS))
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--prefill-seqs", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--disable-overlap", action="store_true")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("roofline.py needs an NVIDIA GPU")

    props = torch.cuda.get_device_properties(0)
    bw, peak = copy_bandwidth(), matmul_flops()
    machine = {"gpu": props.name, "memory_gib": round(props.total_memory / (1 << 30), 1), "copy_gb_s": round(bw / 1e9, 1), "bf16_matmul_tflops": round(peak / 1e12, 1)}
    print(json.dumps(machine))
    rows = []
    for name in args.models.split(","):
        row = measure(name, MODELS[name], args, bw, peak)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
