"""Seeded random traffic on the stub worker: prompts that share prefixes, mixed
lengths, stop token ids, aborts at random rounds, and pools small enough to evict
and retract, over the scheduler configurations. Every request that was not aborted
gets exactly the oracle's tokens; an aborted one gets a prefix of them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from runtime.engine import Engine
from runtime.model_executor.worker import ModelWorkerBatch
from tests.stub_engine import CONFIGS, greedy, make_prompt, on_launch, oracle, submit

SOAK_CONFIGS = ["default", "no-radix", "page4-chunk10", "page16-chunk24", "mixed-page4-chunk10", "lpm-page4"]
TIGHT = dict(max_total_tokens=320, max_running_requests=12, schedule_conservativeness=0.3)


@dataclass(frozen=True, slots=True)
class Traffic:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    stop_ids: list[int]
    abort_at_launch: int | None  # abort it right after this forward (counted from 1) launches


def random_traffic(engine: Engine, seed: int, n: int = 24) -> list[Traffic]:
    rng = random.Random(seed)
    system_prompts = [make_prompt(rng.randrange(8, 90), seed=seed * 100 + i) for i in range(3)]
    traffic = []
    for i in range(n):
        tail = make_prompt(rng.randrange(1, 120), seed=seed * 100 + 50 + i)
        prompt = rng.choice(system_prompts) + tail if rng.random() < 0.5 else tail
        max_new = rng.randrange(1, 48)
        full = oracle(engine, prompt, max_new)
        stop_ids = [full[rng.randrange(max_new)]] if rng.random() < 0.3 else []
        abort = rng.randrange(1, 120) if rng.random() < 0.25 else None
        traffic.append(Traffic(f"r{i}", prompt, max_new, stop_ids, abort))
    return traffic


def abort_on_schedule(engine: Engine, traffic: list[Traffic]) -> None:
    """Abort each request with an `abort_at_launch` right after that forward launches
    (a no-op if it has not arrived yet or already ended)."""
    launches = 0
    due = {t.abort_at_launch: t.rid for t in traffic if t.abort_at_launch is not None}

    def hook(mwb: ModelWorkerBatch) -> bool:
        nonlocal launches
        launches += 1
        if launches in due:
            engine.scheduler.abort(due[launches])
        return launches >= max(due, default=0)

    on_launch(engine, hook)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("overlap", [False, True], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("name", SOAK_CONFIGS)
async def test_random_traffic_gets_the_oracles_tokens_or_a_prefix_when_aborted(
    name: str, overlap: bool, seed: int, make_stub: Callable[..., Engine]
) -> None:
    engine = make_stub(**{**CONFIGS[name], **TIGHT}, disable_overlap_schedule=overlap)
    traffic = random_traffic(engine, seed)
    abort_on_schedule(engine, traffic)
    params = [greedy(t.max_new_tokens, stop_token_ids=t.stop_ids) for t in traffic]
    outs = await asyncio.gather(*(submit(engine, t.rid, t.prompt, p) for t, p in zip(traffic, params)))
    for t, out in zip(traffic, outs):
        expected = oracle(engine, t.prompt, t.max_new_tokens, t.stop_ids)
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            assert t.abort_at_launch is not None, t
            assert out["output_ids"] == expected[: len(out["output_ids"])], t
        else:
            assert out["output_ids"] == expected, t
    assert engine.get_server_info()["num_aborted_requests_total"] <= sum(t.abort_at_launch is not None for t in traffic)
