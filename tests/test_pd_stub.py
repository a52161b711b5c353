"""Prefill/decode disaggregation on the fast tier: two real Engines (schedulers, pools,
bootstrap server, KV transfer over loopback) around StubWorkers (tests/pd_stub_helpers.py).

The stub's "KV" is each slot's token id and its next token a hash of what it reads
back through the slots (tests/stub_engine.py), so a decode server that got the
wrong KV, or put it in the wrong slots, produces the wrong tokens: every output
must equal `oracle`. After every test both servers have every slot and row free.
With tensor-parallel ranks: tests/test_pd_stub_tp.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pd_stub_helpers import PD, free_port, pd_pairs, reason, run
from stub_engine import abort_when, greedy, make_prompts, oracle, stub_engine

from runtime.engine import Engine
from runtime.errors import InvalidRequest
from runtime.managers.io_struct import BootstrapInfo, GenerateOutput


@pytest.fixture
def make_pd() -> Iterator[Callable[..., PD]]:
    yield from pd_pairs()


CONFIGS = {
    "default": {},
    "page16": {"page_size": 16},
    "chunk16": {"chunked_prefill_size": 16},
    "page4-chunk10-no-overlap": {"page_size": 4, "chunked_prefill_size": 10, "disable_overlap_schedule": True},
    "no-radix": {"disable_radix_cache": True},
}


@pytest.mark.parametrize("backend", ["tcp", "gloo"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_decode_outputs_equal_the_oracle(make_pd: Callable[..., PD], backend: str, config: dict[str, Any]) -> None:
    pd = make_pd(backend, **config)
    prompts = make_prompts([3, 17, 40, 64, 100, 5, 33, 1])

    async def main() -> list[tuple[GenerateOutput, GenerateOutput]]:
        return await asyncio.gather(*(pd.pair(p, greedy(12), decode_first=i % 2 == 1) for i, p in enumerate(prompts)))

    for prompt, (p, d) in zip(prompts, run(main())):
        want = oracle(pd.decode, prompt, 12)
        assert d["output_ids"] == want
        assert p["output_ids"] == want[:1], "the prefill server answers with the first token"
        assert reason(p)["type"] == "length" and reason(d)["type"] == "length"
    info = pd.decode.get_server_info()
    assert info["kv_transfers_total"] == len(prompts)
    assert info["kv_transfer_bytes_total"] == sum(len(p) for p in prompts) * 8  # the stub's KV: one int64 per slot


def test_shared_prefixes_hit_the_radix_cache_on_both_sides(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    base = make_prompts([48])[0]
    prompts = [base + [100 + i, 200 + i] for i in range(4)]

    async def main() -> list[tuple[GenerateOutput, GenerateOutput]]:
        first = [await pd.pair(prompts[0], greedy(6))]
        return first + list(await asyncio.gather(*(pd.pair(p, greedy(6)) for p in prompts[1:])))

    for prompt, (p, d) in zip(prompts, run(main())):
        assert d["output_ids"] == oracle(pd.decode, prompt, 6)
    assert pd.prefill.get_server_info()["cached_tokens_total"] >= 3 * 48
    assert pd.decode.get_server_info()["cached_tokens_total"] == pd.prefill.get_server_info()["cached_tokens_total"]


def test_first_token_logprobs_come_from_the_prefill_server(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    plain = stub_engine()
    prompt = make_prompts([20])[0]
    try:
        want = plain.generate(prompt, greedy(5), return_logprob=True, top_logprobs_num=3)
    finally:
        plain.shutdown()
    _, d = run(pd.pair(prompt, greedy(5), return_logprob=True, top_logprobs_num=3))
    assert d["output_ids"] == want["output_ids"]  # type: ignore[index]
    assert d["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]  # type: ignore[index]
    assert d["meta_info"]["output_top_logprobs"] == want["meta_info"]["output_top_logprobs"]  # type: ignore[index]


def test_a_stop_on_the_first_token_ends_the_request_on_the_decode_server(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    prompt = make_prompts([9])[0]
    first = oracle(pd.decode, prompt, 1)[0]
    p, d = run(pd.pair(prompt, {**greedy(10), "ignore_eos": False, "stop_token_ids": [first]}))
    assert d["output_ids"] == [first] and reason(d) == {"type": "stop", "matched": first}


def test_decode_retraction_recomputes_the_prefix_locally(make_pd: Callable[..., PD]) -> None:
    # A decode pool too small for every request's whole output: some are retracted,
    # re-prefilled on the decode server itself, and still give the oracle's tokens. (A low
    # conservativeness makes the prealloc headroom small enough to over-admit.)
    pd = make_pd(decode={"max_total_tokens": 320, "schedule_conservativeness": 0.05})
    prompts = make_prompts([40] * 6)

    async def main() -> list[tuple[GenerateOutput, GenerateOutput]]:
        return await asyncio.gather(*(pd.pair(p, greedy(40)) for p in prompts))

    for prompt, (_, d) in zip(prompts, run(main())):
        assert d["output_ids"] == oracle(pd.decode, prompt, 40)
    assert pd.decode.get_server_info()["num_retracted_reqs_total"] > 0


def test_the_prealloc_queue_waits_for_memory_and_then_admits(make_pd: Callable[..., PD]) -> None:
    pd = make_pd(decode={"max_total_tokens": 256, "max_running_requests": 2})
    prompts = make_prompts([100, 100, 100, 100])

    async def main() -> list[tuple[GenerateOutput, GenerateOutput]]:
        return await asyncio.gather(*(pd.pair(p, greedy(20)) for p in prompts))

    for prompt, (_, d) in zip(prompts, run(main())):
        assert d["output_ids"] == oracle(pd.decode, prompt, 20)


def test_fake_backend_moves_no_kv_and_completes(make_pd: Callable[..., PD]) -> None:
    pd = make_pd("fake")
    prompt = make_prompts([30])[0]
    p = pd.prefill.generate(prompt, greedy(8))  # no bootstrap fields needed
    d = pd.decode.generate(prompt, greedy(8))
    assert p["output_ids"] == oracle(pd.decode, prompt, 1)  # type: ignore[index]
    assert d["output_ids"] == oracle(pd.decode, prompt, 8)  # type: ignore[index]  # decode prefilled it itself
    assert pd.decode.get_server_info()["kv_transfers_total"] == 0


def test_requests_without_bootstrap_fields_are_refused(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    for engine in (pd.prefill, pd.decode):
        with pytest.raises(InvalidRequest, match="bootstrap_room"):
            engine.generate([20, 21, 22], greedy(4))


def test_a_room_already_in_use_is_refused_with_400(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    info = pd.info()

    async def main() -> tuple[GenerateOutput, GenerateOutput, GenerateOutput]:
        a = asyncio.ensure_future(pd.prefill.async_generate([30, 31, 32], greedy(4), bootstrap=info))
        await asyncio.sleep(0.05)
        b = await pd.prefill.async_generate([30, 31, 32], greedy(4), bootstrap=info)
        d = await pd.decode.async_generate([30, 31, 32], greedy(4), bootstrap=info)
        return await a, b, d

    a, b, d = run(main())
    assert reason(b)["status_code"] == 400 and "already in use" in reason(b)["message"]
    assert reason(a)["type"] == "length" and d["output_ids"] == oracle(pd.decode, [30, 31, 32], 4)


# ---- failures: both sides end cleanly (the fixture checks every slot and row is free) ----


def test_a_prefill_request_whose_decode_peer_never_comes_times_out(make_pd: Callable[..., PD]) -> None:
    pd = make_pd(prefill={"disaggregation_timeout": 0.5})
    out = run(pd.prefill.async_generate([40, 41, 42], greedy(4), bootstrap=pd.info()))
    assert reason(out)["status_code"] == 503 and "no decode server claimed" in reason(out)["message"]


def test_a_decode_request_whose_prefill_half_never_comes_times_out_on_both_sides(make_pd: Callable[..., PD]) -> None:
    pd = make_pd(decode={"disaggregation_timeout": 0.5})
    info = pd.info()
    out = run(pd.decode.async_generate([40, 41, 42], greedy(4), bootstrap=info))
    assert reason(out)["status_code"] == 503 and "did not arrive" in reason(out)["message"]
    late = run(pd.prefill.async_generate([40, 41, 42], greedy(4), bootstrap=info))
    assert reason(late).get("status_code") == 503, ("the prefill half must not wait for a peer that gave up", reason(late))


def test_an_unreachable_prefill_server_is_a_503_on_the_decode_server(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    out = run(pd.decode.async_generate([40, 41, 42], greedy(4), bootstrap=BootstrapInfo("127.0.0.1", free_port(), 7)))
    assert reason(out)["status_code"] == 503 and "cannot reach" in reason(out)["message"]


def test_a_page_size_mismatch_fails_both_halves_with_a_clear_error(make_pd: Callable[..., PD]) -> None:
    pd = make_pd(prefill={"page_size": 1}, decode={"page_size": 4})
    for out in run(pd.pair([50, 51, 52, 53], greedy(4))):
        assert reason(out)["status_code"] == 503
        assert "page_size differs" in reason(out)["message"]


def test_a_prompt_that_differs_between_the_halves_fails_both(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    info = pd.info()

    async def main() -> list[GenerateOutput]:
        return list(await asyncio.gather(
            pd.prefill.async_generate([60, 61, 62], greedy(4), bootstrap=info),
            pd.decode.async_generate([60, 61, 62, 63], greedy(4), bootstrap=info),
        ))

    for out in run(main()):
        assert reason(out)["status_code"] == 503 and "not the same request" in reason(out)["message"]


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_an_abort_before_the_peer_half_arrives_ends_that_half_at_once(make_pd: Callable[..., PD], side: str) -> None:
    pd = make_pd(disaggregation_timeout=30.0)
    info = pd.info()
    prompt = make_prompts([30])[0]
    first, second = (pd.prefill, pd.decode) if side == "prefill" else (pd.decode, pd.prefill)

    async def main() -> tuple[GenerateOutput, GenerateOutput]:
        mine = asyncio.ensure_future(first.async_generate(prompt, greedy(8), rid="victim", bootstrap=info))
        queue = "num_prefill_bootstrap_queue_reqs" if side == "prefill" else "num_decode_transfer_queue_reqs"
        while first.get_server_info()[queue] == 0:  # queued, waiting for its peer
            await asyncio.sleep(0.005)
        first.abort("victim")
        out = await mine
        return out, await asyncio.wait_for(second.async_generate(prompt, greedy(8), bootstrap=info), 5)

    mine, late = run(main())
    assert reason(mine) == {"type": "abort", "matched": None, "message": "aborted"}
    assert reason(late)["status_code"] == 503 and f"aborted on the {side} server" in reason(late)["message"]


def test_an_abort_during_the_prefill_forward_ends_the_decode_half(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    info = pd.info()
    prompt = make_prompts([60])[0]
    abort_when(pd.prefill, "victim", lambda mwb: True)  # right after its forward is launched

    async def main() -> list[GenerateOutput]:
        return list(await asyncio.gather(
            pd.prefill.async_generate(prompt, greedy(8), rid="victim", bootstrap=info),
            pd.decode.async_generate(prompt, greedy(8), bootstrap=info),
        ))

    p, d = run(main())
    assert reason(p)["type"] == "abort"
    assert reason(d)["status_code"] == 503 and "aborted" in reason(d)["message"]


def test_an_abort_while_decoding_frees_the_decode_side(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    info = pd.info()
    prompt = make_prompts([20])[0]

    async def main() -> tuple[GenerateOutput, list[GenerateOutput]]:
        p = asyncio.ensure_future(pd.prefill.async_generate(prompt, greedy(1000), bootstrap=info))
        chunks = []
        async for chunk in pd.decode.async_generate_stream(prompt, greedy(1000), rid="d", bootstrap=info):
            chunks.append(chunk)
            if len(chunks) == 3:
                pd.decode.abort("d")
        return await p, chunks

    p, chunks = run(main())
    assert reason(p)["type"] == "length"
    assert reason(chunks[-1])["type"] == "abort"
    assert [t for c in chunks for t in c["output_ids"]] == oracle(pd.decode, prompt, 1000)[: sum(len(c["output_ids"]) for c in chunks)]


def test_a_prefill_server_that_dies_fails_the_decode_requests_waiting_on_it(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()
    prompt = make_prompts([30])[0]
    run(pd.pair(prompt, greedy(3)))  # the bootstrap connection is up
    info = pd.info()

    async def main() -> GenerateOutput:
        d = asyncio.ensure_future(pd.decode.async_generate(prompt, greedy(8), bootstrap=info))
        await asyncio.sleep(0.1)  # reserved, waiting for KV
        await asyncio.to_thread(_kill_bootstrap, pd.prefill)
        return await asyncio.wait_for(d, 3)

    out = run(main())
    assert reason(out)["status_code"] == 503 and "went away" in reason(out)["message"]


def _kill_bootstrap(engine: Engine) -> None:
    """The prefill server's side of every bootstrap connection drops, as when it dies."""
    assert engine.disagg is not None and engine._loop is not None
    engine._loop.call_soon_threadsafe(engine.disagg.close)


def test_queues_show_in_server_info_and_the_log_lines(make_pd: Callable[..., PD]) -> None:
    pd = make_pd()

    async def main() -> dict[str, Any]:
        p = asyncio.ensure_future(pd.prefill.async_generate([70, 71, 72], greedy(4), bootstrap=pd.info(5)))
        await asyncio.sleep(0.05)
        info = pd.prefill.get_server_info()
        await asyncio.gather(p, pd.decode.async_generate([70, 71, 72], greedy(4), bootstrap=pd.info(5)))
        return info

    info = run(main())
    assert info["num_prefill_bootstrap_queue_reqs"] == 1 and info["disaggregation_mode"] == "prefill"


def test_a_tp_size_mismatch_is_refused_at_the_handshake_on_both_sides(make_pd: Callable[..., PD]) -> None:
    # A stub holds no shards, but its layout says its tp_size: TP rank r sends its own
    # heads to the peer's rank r, so both sides must split the heads alike.
    pd = make_pd(prefill={"tp_size": 3}, decode={"tp_size": 1})
    for out in run(pd.pair([50, 51, 52, 53], greedy(4))):
        assert reason(out)["status_code"] == 503
        assert "tp_size differs: this server has" in reason(out)["message"] and "same --tp-size" in reason(out)["message"]
