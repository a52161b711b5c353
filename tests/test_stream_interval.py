"""--stream-interval (SGLang's): a streamed request gets its first token at once, then a chunk
every `stream_interval` output tokens, then its last chunk; the chunks add up to what an
interval of 1 (or no stream) gives: ids, text, logprobs, on the engine and through the
native and OpenAI routes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from config import EngineSettings, SettingsError
from config.cli import build_serve_parser, settings_from_args
from runtime.engine import Engine
from tests.stub_engine import greedy, make_prompts, oracle
from tests.test_trace_app import serving


def stream_chunks(engine: Engine, prompt: list[int], params: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [c async for c in engine.async_generate_stream(prompt, params, **kw)]

    return asyncio.run(run())


@pytest.mark.parametrize(("interval", "sizes"), [(1, [1] * 10), (4, [1, 3, 4, 2]), (3, [1, 2, 3, 3, 1]), (16, [1, 9])])
def test_a_stream_gets_its_first_token_then_a_chunk_every_interval_then_its_end(
    make_stub: Callable[..., Engine], interval: int, sizes: list[int]
) -> None:
    engine = make_stub(stream_interval=interval)
    (prompt,) = make_prompts([9], seed=3)
    chunks = stream_chunks(engine, prompt, greedy(10), return_logprob=True, top_logprobs_num=2)
    assert [len(c["output_ids"]) for c in chunks] == sizes
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [sum(sizes[: i + 1]) for i in range(len(sizes))]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    whole = engine.generate(prompt, greedy(10), return_logprob=True, top_logprobs_num=2)  # no stream: one output
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"] == oracle(engine, prompt, 10)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("output_token_logprobs", "output_top_logprobs"):  # each chunk's entries are its tokens'
        assert [len(c["meta_info"][key]) for c in chunks] == sizes
        assert [e for c in chunks for e in c["meta_info"][key]] == whole["meta_info"][key]


def test_a_stop_string_ends_a_stream_between_its_chunks(make_stub: Callable[..., Engine]) -> None:
    """The stop check runs on every token, not only on the ones a chunk goes out with."""
    (prompt,) = make_prompts([9], seed=3)
    free = make_stub().generate(prompt, greedy(12))["text"]
    stop = free[len(free) // 2 :][:3]  # text the output reaches mid-way, between two chunks of 5
    assert stop and stop in free
    engine = make_stub(stream_interval=5)
    chunks = stream_chunks(engine, prompt, greedy(12, stop=[stop]))
    whole = make_stub().generate(prompt, greedy(12, stop=[stop]))
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert "".join(c["text"] for c in chunks) == whole["text"] == free[: free.index(stop)]
    assert len(chunks) < len(whole["output_ids"])


def test_stream_interval_is_a_flag_and_must_be_positive() -> None:
    engine_settings, _ = settings_from_args(build_serve_parser().parse_args(["--stream-interval", "8"]))
    assert engine_settings.stream_interval == 8
    with pytest.raises(SettingsError, match="stream_interval"):
        EngineSettings(stream_interval=0)


def sse(body: bytes) -> list[dict[str, Any]]:
    events = [e.removeprefix(b"data: ") for e in body.strip().split(b"\n\n")]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


async def itl_count(client: Any) -> float:
    text = (await client.get("/metrics")).text
    (line,) = [x for x in text.splitlines() if x.startswith("sglang:inter_token_latency_seconds_count")]
    return float(line.split()[-1])


async def test_the_routes_stream_chunks_of_several_tokens_that_add_up_to_the_whole() -> None:
    """OpenAI completions (text, logprobs), chat (content, logprobs) and native /generate,
    streamed at interval 4, against the same requests without a stream."""
    (prompt,) = make_prompts([9], seed=5)
    async with serving(stream_interval=4) as (client, engine, state):
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 2}
        events = sse((await client.post("/v1/completions", json={**body, "stream": True})).content)
        whole = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        texts = [e["choices"][0] for e in events if e["choices"]]
        assert len(texts) == 4  # 1, 3, 4 and 2 tokens
        assert "".join(c["text"] for c in texts) == whole["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            assert [x for c in texts for x in c["logprobs"][key]] == whole["logprobs"][key]

        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0,
                "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
        events = sse((await client.post("/v1/chat/completions", json={**chat, "stream": True})).content)
        whole = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]
        deltas = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
        assert len(deltas) <= 4
        assert "".join(d["delta"]["content"] for d in deltas) == whole["message"]["content"]
        assert [x for d in deltas for x in d["logprobs"]["content"]] == whole["logprobs"]["content"]

        native = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}
        itl_before = await itl_count(client)
        events = sse((await client.post("/generate", json={**native, "stream": True})).content)
        assert await itl_count(client) == itl_before + 9  # the histogram counts tokens' gaps, not chunks'
        assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 4, 8, 10]
        assert events[-1]["text"] == (await client.post("/generate", json=native)).json()["text"]  # cumulative text
        assert state.inflight == 0 and not state.groups
        info = (await client.get("/get_server_info")).json()  # what a benchmark record keeps of its server
        assert info["stream_interval"] == 4 and info["page_size"] == engine.settings.page_size


async def test_the_benchmark_client_spreads_a_chunks_wait_over_its_tokens() -> None:
    """`sluice bench serving` against a server streaming chunks of 1, 3, 4 and 2 tokens (a
    real HTTP server on loopback): 9 inter-token gaps, each chunk's wait split evenly."""
    import aiohttp
    from aiohttp import web

    from bench.datasets import BenchRequest
    from bench.serving_client import send_one

    async def generate(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for done in (1, 4, 8, 10):
            await asyncio.sleep(0.02 * (done != 1))
            meta = {"completion_tokens": done, "prompt_tokens": 3, "finish_reason": None if done < 10 else {"type": "length"}}
            await response.write(b"data: " + orjson.dumps({"text": "x", "meta_info": meta}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
            res = await send_one(client, "sluice", BenchRequest(prompt_ids=[1, 2, 3], output_len=10))
    finally:
        await runner.cleanup()
    assert res.success and res.output_len == 10 and len(res.itl) == 9
    groups = [res.itl[0:3], res.itl[3:7], res.itl[7:9]]
    assert all(len(set(g)) == 1 for g in groups)  # a chunk's tokens share its wait
    assert all(0.015 / len(g) < g[0] for g in groups)  # each wait (~20 ms) split over the chunk's tokens
