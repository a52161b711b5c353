"""Benchmark datasets: prompts of exact token counts, built from random token ids.

Prompts are sampled from the tokenizer's vocabulary minus its special and added
tokens and sent as token ids, so the server sees exactly the requested number of
prompt tokens. Routes that only take text (chat) get `text` that re-encodes to
exactly `prompt_len` tokens (see `exact_text`).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from typing import Any

DATASETS = ("random", "generated-shared-prefix")


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    group: int = -1  # shared-prefix group, -1 = none
    text: str | None = None  # filled in only for text-only routes
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


class TokenSampler:
    """Draws ids uniformly from the vocabulary's ordinary (non-special) tokens."""

    def __init__(self, tokenizer: Any, rng: random.Random, vocab_limit: int | None = None) -> None:
        size = len(tokenizer)
        if vocab_limit is not None:
            size = min(size, vocab_limit)
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.ids = [i for i in range(size) if i not in special]
        if not self.ids:
            raise ValueError("the tokenizer has no ordinary tokens to sample from")
        self.rng = rng

    def sample(self, n: int) -> list[int]:
        return self.rng.choices(self.ids, k=n)


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASETS, default="random", help="Which synthetic dataset.")
    g.add_argument("--num-prompts", type=int, default=64, help="Requests of the random dataset.")
    g.add_argument("--random-input-len", type=int, default=256, help="Max prompt tokens (random dataset).")
    g.add_argument("--random-output-len", type=int, default=128, help="Max output tokens (random dataset).")
    g.add_argument(
        "--random-range-ratio", type=float, default=1.0,
        help="Lengths are uniform in [len*ratio, len] (SGLang's meaning); 1.0 = exactly len.",
    )
    g.add_argument("--gsp-num-groups", type=int, default=8, help="Shared-prefix groups.")
    g.add_argument("--gsp-prompts-per-group", type=int, default=16, help="Prompts per group.")
    g.add_argument("--gsp-system-prompt-len", type=int, default=1024, help="Tokens of each group's shared prefix.")
    g.add_argument("--gsp-question-len", type=int, default=64, help="Tokens of each prompt's own suffix.")
    g.add_argument("--gsp-output-len", type=int, default=64, help="Output tokens per prompt.")
    g.add_argument("--gsp-no-shuffle", action="store_true", help="Send groups in order instead of shuffled.")
    g.add_argument("--seed", type=int, default=1, help="Seed of the dataset and of the arrival times.")


def _uniform_len(rng: random.Random, full: int, ratio: float) -> int:
    lo = max(int(full * ratio), 1)
    return rng.randint(lo, max(full, lo))


def random_requests(
    sampler: TokenSampler, num: int, input_len: int, output_len: int, range_ratio: float, rng: random.Random
) -> list[BenchRequest]:
    out = []
    for _ in range(num):
        n_in = _uniform_len(rng, input_len, range_ratio)
        n_out = _uniform_len(rng, output_len, range_ratio)
        out.append(BenchRequest(sampler.sample(n_in), n_out))
    return out


def shared_prefix_requests(
    sampler: TokenSampler,
    num_groups: int,
    per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    rng: random.Random,
    shuffle: bool = True,
) -> list[BenchRequest]:
    """`num_groups` long system prefixes, each followed by `per_group` distinct questions."""
    out = []
    for g in range(num_groups):
        system = sampler.sample(system_len)
        for _ in range(per_group):
            out.append(BenchRequest(system + sampler.sample(question_len), output_len, group=g))
    if shuffle:
        rng.shuffle(out)
    return out


def build_requests(args: argparse.Namespace, tokenizer: Any, vocab_limit: int | None = None) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    sampler = TokenSampler(tokenizer, rng, vocab_limit)
    if args.dataset_name == "random":
        return random_requests(
            sampler, args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, rng
        )
    return shared_prefix_requests(
        sampler,
        args.gsp_num_groups,
        args.gsp_prompts_per_group,
        args.gsp_system_prompt_len,
        args.gsp_question_len,
        args.gsp_output_len,
        rng,
        shuffle=not args.gsp_no_shuffle,
    )


def exact_text(tokenizer: Any, ids: list[int], sampler: TokenSampler, max_rounds: int = 32) -> tuple[str, int]:
    """Text that re-encodes to exactly len(ids) tokens (decode, re-encode, trim or pad, repeat).

    Returns (text, its token count); the count differs from len(ids) only if no
    fixed point was found in `max_rounds` rounds (the caller reports it).
    """
    want = len(ids)
    cur = list(ids)
    text = tokenizer.decode(cur)
    count = 0
    for _ in range(max_rounds):
        text = tokenizer.decode(cur)
        again = tokenizer.encode(text, add_special_tokens=False)
        count = len(again)
        if count == want:
            return text, count
        cur = again[:want] if count > want else again + sampler.sample(want - count)
    return text, count


def attach_texts(requests: list[BenchRequest], tokenizer: Any, seed: int) -> int:
    """Give every request an exact-count `text`; returns how many missed the exact count."""
    sampler = TokenSampler(tokenizer, random.Random(seed + 7))
    misses = 0
    for r in requests:
        r.text, count = exact_text(tokenizer, r.prompt_ids, sampler)
        misses += count != r.prompt_len
    return misses


def warmup_requests(tokenizer: Any, n: int, like: list[BenchRequest], seed: int) -> list[BenchRequest]:
    """Fresh random prompts shaped like the first requests (they share no prefix with
    the dataset, so warming up does not prime the radix cache for it)."""
    sampler = TokenSampler(tokenizer, random.Random(seed + 1_000_003))
    shapes = [like[i % len(like)] for i in range(n)] if like else []
    return [BenchRequest(sampler.sample(r.prompt_len), min(r.output_len, 16)) for r in shapes]
