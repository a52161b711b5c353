"""Prefill/decode disaggregation with tensor parallelism on the fast tier: the pair of
tests/test_pd_stub.py with `ranks` > 1, ranks 1.. being in-process transfer agents
(LoopbackSide) that share rank 0's stub KV. Every rank moves its own part over tcp or
gloo; a rank that fails, is slow or loses its link ends its room cleanly on both
servers, and every slot and row is free after each test (the fixture checks).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pd_stub_helpers import PD, pd_pairs, reason, run
from server_helpers import poll_until
from stub_engine import greedy, make_prompts, oracle

from runtime.disaggregation.rank_agent import RankAgent
from runtime.engine import Engine
from runtime.managers.io_struct import GenerateOutput


@pytest.fixture
def make_pd() -> Iterator[Callable[..., PD]]:
    yield from pd_pairs()


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_every_tp_rank_moves_its_part_and_outputs_equal_the_oracle(make_pd: Callable[..., PD], backend: str) -> None:
    pd = make_pd(backend, ranks=3, chunked_prefill_size=16)
    prompts = make_prompts([3, 17, 40, 64, 5, 33])

    async def main() -> list[tuple[GenerateOutput, GenerateOutput]]:
        return await asyncio.gather(*(pd.pair(p, greedy(10), decode_first=i % 2 == 1) for i, p in enumerate(prompts)))

    for prompt, (p, d) in zip(prompts, run(main())):
        assert d["output_ids"] == oracle(pd.decode, prompt, 10) and p["output_ids"] == d["output_ids"][:1]
    for engine in (pd.prefill, pd.decode):  # every rank's part counted: three copies of the stub's KV
        assert engine.get_server_info()["kv_transfer_bytes_total"] == 3 * sum(len(p) for p in prompts) * 8


def _agent(engine: Engine, rank: int) -> RankAgent:
    agent: RankAgent = engine.worker.tp_channel.agents[rank - 1]  # type: ignore[attr-defined]
    return agent


def test_a_rank_whose_scatter_fails_ends_both_halves_with_a_503(make_pd: Callable[..., PD]) -> None:
    pd = make_pd(ranks=3)

    def fail(slots: Any, kv: Any) -> None:
        raise RuntimeError("no room in its pool")

    _agent(pd.decode, 2)._write = fail  # type: ignore[method-assign]
    for out in run(pd.pair(make_prompts([30])[0], greedy(6))):
        assert reason(out)["status_code"] == 503
        assert "tp rank 2" in reason(out)["message"] and "no room in its pool" in reason(out)["message"]


def test_a_room_ended_while_a_rank_scatters_keeps_its_slots_until_that_rank_reports(make_pd: Callable[..., PD]) -> None:
    pd = make_pd(ranks=2)
    agent, entered, go = _agent(pd.decode, 1), threading.Event(), threading.Event()
    write = agent._write

    def slow(slots: Any, kv: Any) -> None:
        entered.set()
        assert go.wait(30)
        write(slots, kv)

    agent._write = slow  # type: ignore[method-assign]
    prompt = make_prompts([40])[0]
    info = pd.info()

    async def main() -> tuple[GenerateOutput, GenerateOutput]:
        p = asyncio.ensure_future(pd.prefill.async_generate(prompt, greedy(6), bootstrap=info))
        d = asyncio.ensure_future(pd.decode.async_generate(prompt, greedy(6), rid="victim", bootstrap=info))
        assert await asyncio.to_thread(entered.wait, 30), "rank 1 never started writing"
        pd.decode.abort("victim")
        return await p, await d

    p, d = run(main())
    assert reason(d)["type"] == "abort" and reason(p)["status_code"] == 503
    assert pd.decode.flush_cache()
    held = pd.decode.get_server_info()
    assert held["available_kv_tokens"] == held["max_total_num_tokens"] - len(prompt), "freed while rank 1 still writes"
    go.set()
    poll_until(lambda: pd.decode.get_server_info()["available_kv_tokens"] == held["max_total_num_tokens"], 10)


def test_a_rank_link_that_drops_fails_its_room_and_the_next_request_reconnects(make_pd: Callable[..., PD]) -> None:
    pd = make_pd(ranks=2)
    prompts = make_prompts([20, 21, 22])
    assert run(pd.pair(prompts[0], greedy(4)))[1]["output_ids"] == oracle(pd.decode, prompts[0], 4)
    agent = _agent(pd.decode, 1)
    (link,) = agent.links
    agent.loop.call_soon_threadsafe(agent.links[link].close)  # rank 1's connection to the prefill server's rank 1 drops
    poll_until(lambda: link in agent.gone, 10)
    p, d = run(pd.pair(prompts[1], greedy(4)))
    assert reason(d)["status_code"] == 503 and "tp rank 1" in reason(d)["message"]
    assert reason(p)["status_code"] == 503  # (its message depends on which of the abort and the close it saw first)
    _, d = run(pd.pair(prompts[2], greedy(4)))  # a new bootstrap connection, and new rank links
    assert d["output_ids"] == oracle(pd.decode, prompts[2], 4)
