"""The grammar_queue on the fast tier (a real scheduler and a real xgrammar compiler
around a StubWorker, which samples no logits: masks are the slow suite's,
tests/test_structured_output.py). After every test every slot and row is free."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import assert_all_memory_free
from runtime.engine import Engine
from runtime.errors import InvalidRequest
from stub_engine import greedy, make_prompts, oracle, stub_engine


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = stub_engine()
    yield e
    assert_all_memory_free(e)
    e.shutdown()


def big_schema(fields: int) -> str:
    """A JSON schema that takes xgrammar a noticeable time to compile (~0.5 ms a field)."""
    props = {f"f{i}": {"type": "string", "enum": [f"v{i}_{j}" for j in range(20)]} for i in range(fields)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


@pytest.mark.parametrize(
    "constraint",
    [{"regex": "(ab"}, {"json_schema": '{"type": "bogus"}'}, {"json_schema": "{not json"}, {"ebnf": "root ::= missing_rule"}],
    ids=["regex", "schema-type", "schema-syntax", "ebnf"],
)
def test_a_constraint_that_does_not_compile_is_a_400_before_any_kv_is_used(engine: Engine, constraint: dict[str, str]) -> None:
    out: Any = engine.generate([30, 31, 32], {**greedy(4), **constraint})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert reason["message"].startswith(f"invalid {next(iter(constraint))}:")
    assert engine.worker.forwards == 0  # type: ignore[attr-defined]  # the request never reached a batch


def test_two_constraints_at_once_are_refused(engine: Engine) -> None:
    with pytest.raises(InvalidRequest, match="give one constraint"):
        engine.generate([30, 31], {**greedy(4), "regex": "a+", "json_schema": "{}"})


def test_grammar_backend_none_refuses_constraints() -> None:
    e = stub_engine(grammar_backend="none")
    try:
        with pytest.raises(InvalidRequest, match="grammar-backend none"):
            e.generate([30, 31], {**greedy(4), "regex": "a+"})
    finally:
        e.shutdown()


def test_other_streams_keep_decoding_while_a_large_grammar_compiles(engine: Engine) -> None:
    prompt = make_prompts([20])[0]

    async def main() -> tuple[list[float], float, float, list[int]]:
        stamps: list[float] = []
        ids: list[int] = []

        async def stream() -> None:
            async for chunk in engine.async_generate_stream(prompt, greedy(400)):
                stamps.append(time.monotonic())
                ids.extend(chunk["output_ids"])

        streaming = asyncio.ensure_future(stream())
        while len(stamps) < 3:
            await asyncio.sleep(0.001)
        sent = time.monotonic()
        constrained = await engine.async_generate([40, 41, 42], {**greedy(2), "json_schema": big_schema(3000)})
        assert constrained["meta_info"]["finish_reason"]["type"] == "length"
        done = time.monotonic()
        await streaming
        return stamps, sent, done, ids

    stamps, sent, done, ids = asyncio.run(main())
    during = [t for t in stamps if sent < t < done]
    assert done - sent > 0.2, "the schema compiled too fast to show anything"
    assert len(during) >= 5, f"only {len(during)} chunks while the grammar compiled for {done - sent:.2f} s"
    assert ids == oracle(engine, prompt, 400)


def test_an_abort_in_the_grammar_queue_ends_the_request(engine: Engine) -> None:
    async def main() -> Any:
        fut = asyncio.ensure_future(engine.async_generate([40, 41], {**greedy(4), "json_schema": big_schema(2000)}, rid="g"))
        grammars = engine.scheduler.grammars
        assert grammars is not None
        for _ in range(2000):  # until the scheduler has queued it (a loaded machine may take a while)
            if grammars.queue:
                break
            await asyncio.sleep(0.005)
        assert len(grammars.queue) == 1 and not fut.done()
        engine.abort("g")
        return await fut

    out = asyncio.run(main())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_compiled_grammar_is_reused_without_queueing(engine: Engine) -> None:
    schema = big_schema(200)
    engine.generate([40, 41], {**greedy(2), "json_schema": schema})
    assert engine.scheduler.grammars is not None
    fut = engine.scheduler.grammars.backend.compile(("json_schema", schema))
    assert fut.done() and fut.exception() is None
    out: Any = engine.generate([50, 51], {**greedy(2), "json_schema": schema})
    assert out["meta_info"]["finish_reason"]["type"] == "length"
