"""Running benchmark requests through the in-process Engine (offline tools).

Every engine knob is a flag (config.cli.add_settings_arguments); `--ab` variants
are settings overrides run one after another in the same process, so their
numbers are side by side on the same (noisy, shared) machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

from bench.datasets import BenchRequest
from bench.metrics import RequestResult
from config import EngineSettings
from config.cli import add_settings_arguments
from config.settings import settings_fields

ENGINE_FIELDS = frozenset(f.name for f, _ in settings_fields(EngineSettings))


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, EngineSettings)


def engine_settings(ns: argparse.Namespace, **defaults: Any) -> EngineSettings:
    """The settings the user typed; `defaults` fill knobs the user did not type."""
    values = {**defaults, **{k: v for k, v in vars(ns).items() if k in ENGINE_FIELDS}}
    return EngineSettings(**values)


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_overrides(spec: str) -> dict[str, Any]:
    """'disable_overlap_schedule=true,chunked_prefill_size=512' -> a dict of settings."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or key not in ENGINE_FIELDS:
            raise ValueError(f"bad override {part!r}: want KEY=VALUE with KEY an EngineSettings field")
        out[key] = _parse_value(value.strip())
    return out


def variant_settings(base: EngineSettings, spec: str) -> EngineSettings:
    return dataclasses.replace(base, **parse_overrides(spec)) if spec else base


def make_engine(settings: EngineSettings) -> Any:
    from runtime import Engine

    return Engine(settings)


def close_engine(engine: Any) -> None:
    engine.shutdown()
    del engine
    gc.collect()


def each_variant(args: argparse.Namespace, run: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """`run(engine)` on an engine of the base settings, then of each `--ab` variant, one
    engine at a time; each record gets its `variant` ("base" or the spec)."""
    base = engine_settings(args)
    records = []
    for spec in ["", *args.ab]:
        engine = make_engine(variant_settings(base, spec))
        try:
            records.append({"variant": spec or "base", **run(engine)})
        finally:
            close_engine(engine)
    return records


def greedy_params(req: BenchRequest) -> dict[str, Any]:
    return {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}


def generate_all(engine: Any, requests: list[BenchRequest]) -> tuple[list[dict[str, Any]], float]:
    """All requests submitted at once through Engine.generate; (outputs, seconds)."""
    prompts = [r.prompt_ids for r in requests]
    params = [greedy_params(r) for r in requests]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return list(outs), time.perf_counter() - start  # type: ignore[arg-type]


async def stream_one(engine: Any, req: BenchRequest, delay: float = 0.0) -> RequestResult:
    """One streamed request (after `delay` s): TTFT, ITL and E2E as a client on this loop sees them."""
    if delay:
        await asyncio.sleep(delay)
    res = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.output_len)
    start = last = time.perf_counter()
    seen = 0
    try:
        async for chunk in engine.async_generate_stream(req.prompt_ids, greedy_params(req)):
            meta = chunk["meta_info"]
            now = time.perf_counter()
            if meta["completion_tokens"] > seen:
                seen = meta["completion_tokens"]
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
            res.output_len = meta["completion_tokens"]
            res.prompt_len = meta["prompt_tokens"]
            res.cached_tokens = meta["cached_tokens"]
        res.latency = time.perf_counter() - start
        res.success = res.ttft > 0.0
    except Exception as exc:  # noqa: BLE001 - reported as a failed request
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


def stream_all(engine: Any, requests: list[BenchRequest], delays: list[float] | None = None) -> tuple[list[RequestResult], float]:
    """Every request streamed concurrently from a loop in this thread; (results, seconds)."""

    async def run() -> tuple[list[RequestResult], float]:
        start = time.perf_counter()
        waits = delays or [0.0] * len(requests)
        results = await asyncio.gather(*(stream_one(engine, r, d) for r, d in zip(requests, waits)))
        return list(results), time.perf_counter() - start

    return asyncio.run(run())


def warm_up(engine: Any, requests: list[BenchRequest]) -> None:
    """Run `requests` untimed, then empty the prefix cache so they prime nothing."""
    if requests:
        generate_all(engine, requests)
    for _ in range(50):
        if engine.flush_cache():
            return
        time.sleep(0.1)
