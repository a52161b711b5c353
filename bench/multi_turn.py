"""`sluice bench multi-turn`: conversations, the prefix cache's everyday job.

Each of `--conversations` conversations starts from a random `--first-len`-token prompt;
every turn generates `--answer-len` greedy tokens, and the next turn's prompt is the
previous prompt, that answer and a new `--user-len`-token message. Per turn: the time to
the first token (the turn's prompt sent with max_new_tokens = 1, so the number is the
prefill of what the cache does not hold) and the tokens the cache served.

A next turn marks the earlier answers in its prompt, as the chat route does
(runtime/token_roles.py TokenPrompt); `--unmarked-answers` sends them as plain tokens, as a
client of /generate does. Under `--ab enable_deterministic_inference=true` only a marked
answer's KV is shared (that mode's tree keys a token by its role). `--cold` empties the
cache before each turn's first token: what a turn costs when its history is not cached
(evicted, or another replica's), where that mode prefills marked answers on the kernel
they were decoded on.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench.datasets import TokenSampler
from bench.engine_runs import add_engine_arguments, each_variant
from bench.metrics import save_records
from runtime.token_roles import TokenPrompt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=int, default=3, help="Conversations, run one after another.")
    parser.add_argument("--turns", type=int, default=4, help="Turns per conversation.")
    parser.add_argument("--first-len", type=int, default=128, help="Tokens of the first prompt.")
    parser.add_argument("--user-len", type=int, default=32, help="Tokens of each later user message.")
    parser.add_argument("--answer-len", type=int, default=128, help="Greedy tokens of each answer.")
    parser.add_argument("--unmarked-answers", action="store_true", help="Send earlier answers back as plain prompt tokens.")
    parser.add_argument("--cold", action="store_true", help="Empty the prefix cache before each turn's first token.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the random token ids.")
    parser.add_argument("--ab", action="append", default=[], help="Settings variant KEY=VALUE[,...] run after the base.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per variant.")
    add_engine_arguments(parser)


def run_conversations(engine: Any, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per turn (as a string key): first-token seconds and cached tokens, one entry per conversation."""
    tokens = TokenSampler(engine.tokenizer, random.Random(args.seed), engine.model_config.vocab_size).sample
    answer = {"max_new_tokens": args.answer_len, "temperature": 0, "ignore_eos": True}
    ttft: dict[str, list[float]] = {str(t): [] for t in range(args.turns)}
    cached: dict[str, list[float]] = {str(t): [] for t in range(args.turns)}  # (ints)
    for _ in range(args.conversations):
        assert engine.wait_idle(timeout=60) and engine.flush_cache(), "engine did not go idle"
        prompt = TokenPrompt(tokens(args.first_len))
        for turn in range(args.turns):
            if args.cold:
                assert engine.wait_idle(timeout=60) and engine.flush_cache(), "engine did not go idle"
            start = time.perf_counter()
            first = engine.generate(prompt, {**answer, "max_new_tokens": 1})
            ttft[str(turn)].append(time.perf_counter() - start)
            cached[str(turn)].append(first["meta_info"]["cached_tokens"])
            out = engine.generate(prompt, answer)["output_ids"]
            n = len(prompt.input_ids)
            spans = prompt.answer_spans if args.unmarked_answers else (*prompt.answer_spans, (n, n + len(out)))
            prompt = TokenPrompt(prompt.input_ids + out + tokens(args.user_len), spans)
    return {"ttft_s": ttft, "cached_tokens": cached}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    records = each_variant(args, lambda engine: run_conversations(engine, args))
    for r in records:
        medians = {t: round(statistics.median(v) * 1e3, 1) for t, v in r["ttft_s"].items()}
        hits = {t: statistics.median(v) for t, v in r["cached_tokens"].items()}
        print(f"[{r['variant']}] median TTFT per turn (ms): {medians}; median cached tokens: {hits}")
    save_records(args.output_file, "multi-turn", records, args)
    return records


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
