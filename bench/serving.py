"""`sluice bench serving`: an asyncio HTTP client against a running server.

Backends: `sluice` (native POST /generate, token ids in, SSE of cumulative chunks),
`openai` (/v1/completions with token-id prompts), `openai-chat` (/v1/chat/completions,
text only: each prompt is text that re-encodes to exactly the requested count; the
chat template then adds its own tokens, which the server-reported prompt count
includes). Every request asks for ignore_eos and max tokens = its output length,
so output counts are exact; the counts reported are the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from bench.datasets import BenchRequest, add_dataset_arguments, attach_texts, build_requests, warmup_requests
from bench.metrics import RequestResult, append_jsonl, compute_metrics, format_report, machine_info

if TYPE_CHECKING:
    import httpx
    import numpy as np

BACKENDS = ("sluice", "openai", "openai-chat")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="sluice", help="Which route to drive.")
    parser.add_argument("--base-url", default="http://127.0.0.1:30000", help="The server.")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer dir. Default: the server's (GET /get_model_info).")
    parser.add_argument("--api-key", default=None, help="Bearer token, if the server wants one.")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second; inf = all at once.")
    parser.add_argument("--max-concurrency", type=int, default=None, help="At most this many requests in flight.")
    parser.add_argument("--warmup-requests", type=int, default=1, help="Untimed requests sent first.")
    parser.add_argument("--no-flush-cache", action="store_true", help="Do not POST /flush_cache after the warm-up.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line with every metric and the args.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    add_dataset_arguments(parser)


# ---- one request per backend ------------------------------------------------------------


async def _sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[6:].encode()
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


async def send_one(client: httpx.AsyncClient, backend: str, req: BenchRequest) -> RequestResult:
    import httpx
    import orjson

    path, body = _payload(backend, req)
    res = RequestResult(prompt_len=req.prompt_len, expected_output_len=req.output_len)
    start = time.perf_counter()
    last = start
    seen = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                res.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return res
            async for data in _sse_data(response):
                event = orjson.loads(data)
                if "error" in event:
                    res.error = str(event["error"])[:200]
                    return res
                fresh, seen = _new_output(backend, event, seen)
                now = time.perf_counter()
                if fresh:
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                _final_counts(backend, event, res)
        res.latency = time.perf_counter() - start
        res.success = res.ttft > 0.0
        if not res.success:
            res.error = "the stream carried no output"
    except (httpx.HTTPError, OSError, ValueError) as exc:
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


async def _flush(client: httpx.AsyncClient) -> bool:
    # The warm-up's last overlap step may still be in flight: retry briefly.
    for _ in range(50):
        r = await client.post("/flush_cache")
        if r.status_code == 200:
            return True
        await asyncio.sleep(0.1)
    return False


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import numpy as np

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        info_r = await client.get("/get_model_info")
        info = info_r.json() if info_r.status_code == 200 else None
        tokenizer = await asyncio.to_thread(load_tokenizer, args, info)
        requests = build_requests(args, tokenizer)
        warm = warmup_requests(tokenizer, args.warmup_requests, requests, args.seed)
        text_misses = 0
        if args.backend == "openai-chat":
            text_misses = attach_texts(requests, tokenizer, args.seed) + attach_texts(warm, tokenizer, args.seed + 1)

        warm_results = await asyncio.gather(*(send_one(client, args.backend, r) for r in warm))
        bad = [r.error for r in warm_results if not r.success]
        if bad:
            raise RuntimeError(f"warm-up failed: {bad[0]}")
        flushed = None if args.no_flush_cache else await _flush(client)

        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc="requests")

        async def limited(req: BenchRequest) -> RequestResult:
            if semaphore is None:
                res = await send_one(client, args.backend, req)
            else:
                async with semaphore:
                    res = await send_one(client, args.backend, req)
            bar.update(1)
            return res

        rng = np.random.default_rng(args.seed)
        start = time.perf_counter()
        tasks = [asyncio.create_task(limited(requests[i])) async for i in _arrivals(len(requests), args.request_rate, rng)]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
        server = await client.get("/get_server_info")
        server_info = server.json() if server.status_code == 200 else {}

    m = compute_metrics(results, duration)
    header = [
        ("Backend:", args.backend),
        ("Traffic request rate:", args.request_rate),
        ("Max request concurrency:", args.max_concurrency or "not set"),
    ]
    print(format_report(m, header))
    if text_misses:
        print(f"note: {text_misses} chat prompts could not be made to re-encode to the exact count")
    record = {
        "tool": "serving", **m, "flushed_cache": flushed, "chat_text_misses": text_misses,
        "server_info": server_info, "machine": machine_info(), "args": vars(args),
    }
    if args.output_file:
        append_jsonl(args.output_file, record)
    return record


def main(args: argparse.Namespace) -> int:
    import httpx

    try:
        record = asyncio.run(run(args))
    except (httpx.HTTPError, OSError, RuntimeError) as exc:
        print(f"sluice bench serving: error: {exc}", file=sys.stderr)
        return 1
    return 0 if record["failed"] == 0 else 1
