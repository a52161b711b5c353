"""The client of `sluice bench serving` (bench/serving.py): one streamed request per
backend, one run against a server (warm-up, flush, the timed requests, the metrics).

The client is aiohttp (SGLang's bench_serving's): the benchmark shares the machine
with the server it measures, and its parse of every streamed event is CPU taken from the
server. httpx's pure-Python streaming took 0.49-0.76 s of CPU in a 16-stream run of 4096
events on a 2-core Zen 4, aiohttp's C parser 0.23-0.31 s (bench/RESULTS.md item 38).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.datasets import BenchRequest, attach_texts, build_requests, warmup_requests
from bench.metrics import RequestResult, append_jsonl, compute_metrics, format_report, machine_info

if TYPE_CHECKING:
    import aiohttp
    import numpy as np

BACKENDS = ("sluice", "openai", "openai-chat")
JSON = {"Content-Type": "application/json"}


# ---- one request per backend ------------------------------------------------------------


async def _sse_data(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The payloads of an SSE stream's `data:` lines, up to `[DONE]`. Lines are split
    here rather than by aiohttp's readline, which caps a line's length (a cumulative
    chunk of a long output can exceed it)."""
    pending = b""
    async for piece in response.content.iter_any():
        pending += piece
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data: "):
                data = line[6:].rstrip(b"\r")
                if data == b"[DONE]":
                    return
                yield data


def _payload(backend: str, req: BenchRequest) -> tuple[str, dict[str, Any]]:
    if backend == "sluice":
        params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}
        return "/generate", {"input_ids": req.prompt_ids, "sampling_params": params, "stream": True}
    common = {
        "max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if backend == "openai":
        return "/v1/completions", {"prompt": req.prompt_ids, **common}
    assert req.text is not None, "openai-chat needs texts (attach_texts)"
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": req.text}], **common}


def _new_output(backend: str, event: dict[str, Any], seen: int) -> tuple[bool, int]:
    """(does this chunk carry new output?, output count so far)."""
    if backend == "sluice":
        n = int((event.get("meta_info") or {}).get("completion_tokens") or len(event.get("output_ids") or []))
        return n > seen, max(n, seen)
    choices = event.get("choices") or []
    if not choices:
        return False, seen
    c = choices[0]
    text = c.get("text") if backend == "openai" else (c.get("delta") or {}).get("content")
    return bool(text), seen + (1 if text else 0)


def _final_counts(backend: str, event: dict[str, Any], res: RequestResult) -> None:
    if backend == "sluice":
        meta = event.get("meta_info") or {}
        if "completion_tokens" in meta:
            res.output_len = int(meta["completion_tokens"])
            res.prompt_len = int(meta.get("prompt_tokens") or res.prompt_len)
            res.cached_tokens = int(meta.get("cached_tokens") or 0)
    elif event.get("usage"):
        usage = event["usage"]
        res.output_len = int(usage["completion_tokens"])
        res.prompt_len = int(usage["prompt_tokens"])
        res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


async def send_one(client: aiohttp.ClientSession, backend: str, req: BenchRequest) -> RequestResult:
    import aiohttp
    import orjson

    path, body = _payload(backend, req)
    res = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.output_len)
    start = time.perf_counter()
    last = start
    seen = 0
    try:
        async with client.post(path, data=orjson.dumps(body), headers=JSON) as response:
            if response.status != 200:
                res.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return res
            async for data in _sse_data(response):
                event = orjson.loads(data)
                if "error" in event:
                    res.error = str(event["error"])[:200]
                    return res
                before = seen
                fresh, seen = _new_output(backend, event, seen)
                now = time.perf_counter()
                if fresh:
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:  # a chunk of k tokens (--stream-interval k): k gaps of 1/k its wait, as SGLang's client
                        k = seen - before
                        res.itl.extend([(now - last) / k] * k)
                    last = now
                _final_counts(backend, event, res)
        res.latency = time.perf_counter() - start
        res.success = res.ttft > 0.0
        if not res.success:
            res.error = "the stream carried no output"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


# ---- the run ------------------------------------------------------------------------------------


async def _arrivals(n: int, rate: float, rng: np.random.Generator) -> AsyncIterator[int]:
    for i in range(n):
        yield i
        if rate != float("inf") and i + 1 < n:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


def load_tokenizer(args: argparse.Namespace, info: dict[str, Any] | None) -> Any:
    from transformers import AutoTokenizer

    from runtime.model_executor.model_loader import prepare_model_dir

    candidates = [args.tokenizer] if args.tokenizer else []
    if info:
        candidates += [info.get("tokenizer_path"), info.get("model_path")]
    for path in filter(None, candidates):
        try:
            return AutoTokenizer.from_pretrained(str(prepare_model_dir(path, "auto")))
        except (OSError, ValueError):
            continue
    return AutoTokenizer.from_pretrained(str(prepare_model_dir(None, "auto")))


async def _flush(client: aiohttp.ClientSession) -> bool:
    # The warm-up's last overlap step may still be in flight: retry briefly.
    for _ in range(50):
        async with client.post("/flush_cache") as r:
            if r.status == 200:
                return True
        await asyncio.sleep(0.1)
    return False


async def _get_json(client: aiohttp.ClientSession, path: str) -> dict[str, Any] | None:
    async with client.get(path) as r:
        return await r.json(content_type=None) if r.status == 200 else None


@dataclass(slots=True)
class Workload:
    """One run's requests, built once so a second server gets the identical list."""

    tokenizer: Any
    requests: list[BenchRequest]
    warm: list[BenchRequest]
    text_misses: int = 0


def build_workload(args: argparse.Namespace, tokenizer: Any) -> Workload:
    requests = build_requests(args, tokenizer)
    warm = warmup_requests(tokenizer, args.warmup_requests, requests, args.seed)
    text_misses = 0
    if args.backend == "openai-chat":
        text_misses = attach_texts(requests, tokenizer, args.seed) + attach_texts(warm, tokenizer, args.seed + 1)
    return Workload(tokenizer, requests, warm, text_misses)


async def bench_server(
    args: argparse.Namespace,
    base_url: str,
    backend: str,
    work: Workload | None = None,
    *,
    flush: bool = True,
    title: str = " Serving Benchmark Result ",
) -> tuple[dict[str, Any], Workload]:
    """Warm up, (flush,) send `work` (built from the server's tokenizer if None); the metrics record."""
    import aiohttp
    import numpy as np

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # A connection per request (force_close), as SGLang's bench_serving opens a session per
    # request: llama-server closes a kept-alive connection after a few requests, and a
    # pooled connection it has just closed fails the next request ("Can not write request body").
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    session = aiohttp.ClientSession(base_url, headers=headers, timeout=aiohttp.ClientTimeout(total=None), connector=connector)
    async with session as client:
        if work is None:
            info = await _get_json(client, "/get_model_info")
            tokenizer = await asyncio.to_thread(load_tokenizer, args, info)
            work = build_workload(args, tokenizer)
        requests = work.requests

        warm_results = await asyncio.gather(*(send_one(client, backend, r) for r in work.warm))
        bad = [r.error for r in warm_results if not r.success]
        if bad:
            raise RuntimeError(f"warm-up failed: {bad[0]}")
        flushed = await _flush(client) if flush else None

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")

        async def limited(req: BenchRequest) -> RequestResult:
            if semaphore is None:
                res = await send_one(client, backend, req)
            else:
                async with semaphore:
                    res = await send_one(client, backend, req)
            bar.update(1)
            return res

        rng = np.random.default_rng(args.seed)
        start = time.perf_counter()
        tasks = [asyncio.create_task(limited(requests[i])) async for i in _arrivals(len(requests), args.request_rate, rng)]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
        server_info = await _get_json(client, "/get_server_info")
        if server_info is None:
            server_info = await _get_json(client, "/props") or {}  # llama-server's

    m = compute_metrics(results, duration)
    header = [
        ("Backend:", backend),
        ("Traffic request rate:", args.request_rate),
        ("Max request concurrency:", args.max_concurrency or "not set"),
    ]
    print(format_report(m, header, title))
    if work.text_misses:
        print(f"note: {work.text_misses} chat prompts could not be made to re-encode to the exact count")
    record = {**m, "flushed_cache": flushed, "chat_text_misses": work.text_misses, "server_info": server_info}
    return record, work


async def run(args: argparse.Namespace) -> dict[str, Any]:
    record, _ = await bench_server(args, args.base_url, args.backend, flush=not args.no_flush_cache)
    record = {"tool": "serving", **record, "machine": machine_info(), "args": vars(args)}
    if args.output_file:
        append_jsonl(args.output_file, record)
    return record


