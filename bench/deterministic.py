"""`sluice bench deterministic`: does a temperature-0 completion depend on its batch?

Issue #17's experiment. Eight target prompts (random token ids, 16 to ~200 tokens;
two pairs share a long prefix) are each generated alone on an empty cache: the
reference. Then the same targets run in five batch compositions, 40 completions:

  together   the eight at once
  fillers    with eight other prompts of other lengths, shuffled in
  staggered  arriving while eight long fillers are decoding (prefill beside decodes)
  cached     after their first halves were prompts, so the radix cache serves a prefix
  trickle    one by one into a running batch of fillers (batch size changes each step)

and every completion that differs from its reference is counted. `--ab
enable_deterministic_inference=true` runs the same experiment with the flag in the
same process; each variant also reports its wall time (the cost of the mode on this
workload: 48 completions of `--max-new-tokens`).
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.datasets import TokenSampler
from bench.engine_runs import add_engine_arguments, each_variant
from bench.metrics import save_records

Tokens = list[int]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=32, help="Output tokens per completion.")
    parser.add_argument("--seed", type=int, default=7, help="Seed of the prompts.")
    parser.add_argument("--ab", action="append", default=[], help="Settings variant KEY=VALUE[,...] run after the base.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per variant.")
    add_engine_arguments(parser)


def make_prompts(sampler: TokenSampler, rng: random.Random) -> tuple[list[Tokens], list[Tokens]]:
    """(8 targets, 8 fillers). Targets 4/5 and 6/7 share a 96-token prefix."""
    targets = [sampler.sample(n) for n in (16, 37, 64, 130, 0, 0, 0, 0)]
    for i in (4, 6):
        shared = sampler.sample(96)
        targets[i], targets[i + 1] = shared + sampler.sample(rng.randint(8, 80)), shared + sampler.sample(rng.randint(8, 80))
    fillers = [sampler.sample(rng.randint(8, 220)) for _ in range(8)]
    return targets, fillers


def _greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def _flush(engine: Any) -> None:
    assert engine.wait_idle(timeout=60) and engine.flush_cache(), "engine did not go idle"


def _ids(outs: Any) -> list[Tokens]:
    return [o["output_ids"] for o in outs]


def beside_fillers(engine: Any, fillers: list[Tokens], run: Callable[[], list[Tokens]], n: int) -> list[Tokens]:
    """`run()` once every filler (4n output tokens each) is decoding."""
    done = threading.Event()

    def decode_fillers() -> None:
        engine.generate(fillers, _greedy(4 * n))
        done.set()

    thread = threading.Thread(target=decode_fillers, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while engine.num_running_reqs < len(fillers) and not done.is_set() and time.monotonic() < deadline:
        time.sleep(0.005)  # polling a condition, not a stand-in for one
    out = run()
    thread.join()
    return out


def compositions(engine: Any, targets: list[Tokens], fillers: list[Tokens], n: int, rng: random.Random) -> dict[str, list[Tokens]]:
    """Every composition's outputs for the targets, in target order (the cache is empty before each)."""
    out: dict[str, list[Tokens]] = {}
    _flush(engine)
    out["together"] = _ids(engine.generate(targets, _greedy(n)))
    _flush(engine)
    order = list(range(len(targets) + len(fillers)))
    rng.shuffle(order)
    mixed = [(targets + fillers)[i] for i in order]
    got = _ids(engine.generate(mixed, _greedy(n)))
    out["fillers"] = [got[order.index(i)] for i in range(len(targets))]
    _flush(engine)
    out["staggered"] = beside_fillers(engine, fillers, lambda: _ids(engine.generate(targets, _greedy(n))), n)
    _flush(engine)
    engine.generate([t[: len(t) // 2] for t in targets], _greedy(1))
    out["cached"] = _ids(engine.generate(targets, _greedy(n)))
    _flush(engine)
    out["trickle"] = beside_fillers(engine, fillers, lambda: [engine.generate(t, _greedy(n))["output_ids"] for t in targets], n)
    return out


def run_variant(engine: Any, targets: list[Tokens], fillers: list[Tokens], n: int, seed: int) -> dict[str, Any]:
    start = time.perf_counter()
    alone = []
    for t in targets:
        _flush(engine)
        alone.append(engine.generate(t, _greedy(n))["output_ids"])
    batched = compositions(engine, targets, fillers, n, random.Random(seed))
    seconds = time.perf_counter() - start
    differ = {name: sum(a != b for a, b in zip(alone, outs)) for name, outs in batched.items()}
    return {
        "completions": len(targets) * (1 + len(batched)),
        "batched_completions": len(targets) * len(batched),
        "differ_from_alone": sum(differ.values()),
        "differ_by_composition": differ,
        "seconds": seconds,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    def one(engine: Any) -> dict[str, Any]:
        rng = random.Random(args.seed)
        sampler = TokenSampler(engine.tokenizer, rng, engine.model_config.vocab_size)
        targets, fillers = make_prompts(sampler, rng)
        r = run_variant(engine, targets, fillers, args.max_new_tokens, args.seed)
        return {**r, "quantization": engine.settings.quantization, "dtype": str(engine.model_config.dtype).removeprefix("torch.")}

    records = each_variant(args, one)
    for r in records:
        print(
            f"[{r['variant']}] {r['dtype']}/{r['quantization']}: {r['differ_from_alone']} of {r['batched_completions']} "
            f"batched completions differ from alone ({r['differ_by_composition']}); {r['seconds']:.1f} s"
        )
    save_records(args.output_file, "deterministic", records, args)
    return records


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
