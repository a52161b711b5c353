"""`sluice bench decode-step`: one decode step's model forward, eager vs fused vs compiled.

A real decode batch (`--batch-size` requests, `--input-len` prompt tokens each) is
captured from the engine's worker; then `ModelRunner.forward_logits` on it (model
forward + logits, no sampling, no scheduling) is timed `--iters` times per variant,
the variants interleaved round by round so that a noisy machine hits them alike:

  eager     the torch code of every decoder layer (no fused kernels bound)
  fused     the C++ kernels bound: RMSNorm+residual, RoPE, SiLU·mul
  compiled  torch.compile (inductor, dynamic batch size) of the whole decode forward
            over the torch code: one graph, the KV write + paged decode kernel wrapped
            as a custom op (`sluice_bench::decode_attention`) so nothing breaks it; its
            compile time (first call) is reported separately

All three run the same attention kernel and the same LM head (the exact Q8 one when
the model has it). `--profile` prints torch.profiler's top ops of the fused variant.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

from bench.engine_runs import add_engine_arguments, close_engine, engine_settings, make_engine
from bench.metrics import save_records

VARIANTS = ("eager", "fused", "compiled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=1, help="Requests in the decode batch.")
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens per request.")
    parser.add_argument("--iters", type=int, default=30, help="Timed steps per variant per round.")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds; variants alternate within each.")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="Which to time.")
    parser.add_argument("--compile-mode", default="default", help="torch.compile mode (default, max-autotune-no-cudagraphs).")
    parser.add_argument("--profile", action="store_true", help="Print the fused variant's top ops.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line.")
    add_engine_arguments(parser)


def capture_decode_batch(engine: Any, bs: int, input_len: int) -> Any:
    runner, caught = engine.worker, cast(list[Any], [])
    inner = runner.forward_logits

    def spy(fb: Any) -> Any:
        if fb.forward_mode.is_decode() and fb.batch_size == bs and not caught:
            caught.append(fb)
        return inner(fb)

    runner.forward_logits = spy
    try:
        prompts = [[1000 + (7 * i + j) % 30000 for j in range(input_len)] for i in range(bs)]
        engine.generate(prompts, {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    finally:
        del runner.forward_logits  # back to the class's method
    fb = caught[0]
    # The backend's plan is the last batch's by now (the runner plans in forward_batch_of,
    # not in forward_logits): plan this one again, or its attention reads another batch's rows.
    fb.attn_backend.init_forward_metadata(fb)
    return fb


def compile_decode(model: Any, fb: Any, mode: str) -> tuple[Callable[[Any], Any], float]:
    """The decode forward as one torch.compile graph; (step(fb) -> logits, compile seconds)."""
    import torch
    from torch.nn import functional as F

    from kernels.cpu import load_cpu_ops
    from runtime.layers.rotary_embedding import apply_rotary

    ops = load_cpu_ops()
    assert ops is not None

    schema = (
        "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc, Tensor kv_idx, "
        "Tensor lens, float scale) -> Tensor"
    )  # explicit: this module's annotations are strings (no torch import at its top level)

    @torch.library.custom_op("sluice_bench::decode_attention", mutates_args=("k_buf", "v_buf"), schema=schema)
    def decode_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
        loc: torch.Tensor, kv_idx: torch.Tensor, lens: torch.Tensor, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        k_buf[loc] = k.to(k_buf.dtype)
        v_buf[loc] = v.to(v_buf.dtype)
        return ops.paged_decode(q, k_buf, v_buf, kv_idx, lens, scale)

    @decode_attention.register_fake
    def _(q: torch.Tensor, *rest: Any) -> torch.Tensor:
        return torch.empty_like(q)

    inner = model.model
    kv = fb.kv_pool

    def norm(layer_norm: Any, x: torch.Tensor) -> torch.Tensor:
        return layer_norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=layer_norm.eps).to(x.dtype)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor, kv_idx: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        residual = h
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = norm(layer.input_layernorm, residual)
            t = x.shape[0]
            q, k, v = attn.qkv_proj(x).split((attn.q_size, attn.kv_size, attn.kv_size), dim=-1)
            q = apply_rotary(q.view(t, attn.num_heads, attn.head_dim), cos, sin)
            k = apply_rotary(k.view(t, attn.num_kv_heads, attn.head_dim), cos, sin)
            v = v.view(t, attn.num_kv_heads, attn.head_dim)
            o = decode_attention(q, k, v, kv.k_buffer[i], kv.v_buffer[i], loc, kv_idx, lens, attn.attn.scaling)
            residual = residual + attn.o_proj(o.reshape(t, attn.q_size))
            residual = residual + layer.mlp(norm(layer.post_attention_layernorm, residual))
        return norm(inner.norm, residual)

    step = torch.compile(forward, dynamic=True, mode=None if mode == "default" else mode)
    # The backend's decode plan for this batch (kv_idx and lens; under deterministic
    # inference, its per-query plan: a decode's token t is request t's one).
    plan = fb.attn_backend.decode_attention_plan()
    assert plan is not None, "the compiled variant needs the CPU kernels' decode plan"

    def run(fb_: Any) -> Any:  # the LM head outside the graph, as in the other variants
        return model.compute_logits(step(fb_.input_ids, fb_.positions, fb_.out_cache_loc, plan.kv_idx, plan.lens))

    start = time.perf_counter()
    with torch.inference_mode():
        run(fb)
    return run, time.perf_counter() - start


def _layer_state(model: Any) -> list[tuple[Any, Any]]:
    """The decoder layers' fused-op slots (the LM head keeps its Q8 kernel in every variant)."""
    from runtime.layers.logits_processor import LogitsProcessor

    return [(m, m.ops) for m in model.modules() if hasattr(m, "ops") and not isinstance(m, LogitsProcessor)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    # The whole batch prefilled in one forward, as one-batch does: chunked prefills would let
    # the first requests finish their tokens before the last join, and no decode batch of
    # batch_size rows would ever run.
    bs = max(args.batch_size, 1)
    engine = make_engine(engine_settings(
        args, max_running_requests=bs, chunked_prefill_size=-1, max_prefill_tokens=max(bs * args.input_len, 16384)
    ))
    try:
        runner, model = engine.worker, engine.worker.model
        fb = capture_decode_batch(engine, args.batch_size, args.input_len)
        bound = _layer_state(model)

        def set_fused(on: bool) -> None:
            for module, ops in bound:
                module.ops = ops if on else None

        compiled_forward: Callable[..., Any] | None = None
        compile_s = float("nan")
        if "compiled" in args.variants:
            set_fused(False)  # inductor fuses the torch code itself
            compiled_forward, compile_s = compile_decode(model, fb, args.compile_mode)

        def timed(variant: str) -> list[float]:
            set_fused(variant == "fused")
            fn = compiled_forward if variant == "compiled" else runner.forward_logits
            assert fn is not None
            out = []
            with torch.inference_mode():
                for _ in range(3):
                    fn(fb)
                for _ in range(args.iters):
                    start = time.perf_counter()
                    fn(fb)
                    out.append(time.perf_counter() - start)
            return out

        samples: dict[str, list[float]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):
            for v in args.variants:
                samples[v] += timed(v)
        set_fused(True)
        record: dict[str, Any] = {
            "batch_size": args.batch_size, "input_len": args.input_len, "threads": torch.get_num_threads(),
            "quantization": engine.settings.quantization, "dtype": str(engine.model_config.dtype).removeprefix("torch."),
            "compile_s": compile_s,
        }  # fmt: skip
        for v, ts in samples.items():
            record[f"{v}_median_ms"] = statistics.median(ts) * 1e3
            record[f"{v}_min_ms"] = min(ts) * 1e3
            print(f"{v:9s} median {record[f'{v}_median_ms']:7.2f} ms  min {record[f'{v}_min_ms']:7.2f} ms  ({len(ts)} steps)")
        if "compiled" in args.variants:
            print(f"compile (first call) {compile_s:.1f} s")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    runner.forward_logits(fb)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    finally:
        close_engine(engine)
    save_records(args.output_file, "decode-step", [record], args)
    return record


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
