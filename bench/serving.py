"""`sluice bench serving`: an asyncio HTTP client against a running server.

Backends: `sluice` (native POST /generate, token ids in, SSE of cumulative chunks),
`openai` (/v1/completions with token-id prompts), `openai-chat` (/v1/chat/completions,
text only: each prompt is text that re-encodes to exactly the requested count; the
chat template then adds its own tokens, which the server-reported prompt count
includes). Every request asks for ignore_eos and max tokens = its output length,
so output counts are exact; the counts reported are the server's.

The client and one run: bench/serving_client.py (aiohttp, which takes the server it
measures little CPU).

`--compare-llamacpp BIN` (bench/serving_compare.py) then starts llama.cpp's `llama-server`
from BIN on the same GGUF (bench/llamacpp.py), sends it the identical request list
(token-id prompts on its /v1/completions, or the same texts on /v1/chat/completions) with
the same warm-up, concurrency and arrivals, and prints sluice / llama.cpp ratios.
`--compare-rounds N` alternates the two N times on fresh requests each round and compares medians: on a
shared VM one engine's run and the other's can see machines of different speed (llama-
server's 16-stream tok/s ranged 100-131 within 4 minutes of one session, item 38).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bench.datasets import add_dataset_arguments
from bench.serving_client import BACKENDS, run


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
    g = parser.add_argument_group("llama.cpp comparison")
    g.add_argument(
        "--compare-llamacpp", metavar="BIN", default=None,
        help="After the run, start this llama-server binary, send it the identical requests and print sluice/llama.cpp ratios.",
    )
    g.add_argument("--llamacpp-model", metavar="GGUF", default=None, help="GGUF for llama-server. Default: the embedded SmolLM2 GGUF.")
    g.add_argument("--llamacpp-parallel", type=int, default=None, help="llama-server slots (-np). Default: --max-concurrency, else every request.")
    g.add_argument("--llamacpp-threads", type=int, default=None, help="llama-server --threads. Default: every core.")
    g.add_argument(
        "--compare-rounds", type=int, default=1,
        help="Alternate the two engines this many times (round i: fresh requests from --seed + i, sluice then "
        "llama.cpp) and compare the medians: a shared VM's speed drifts between one engine's run and the other's.",
    )
    add_dataset_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import aiohttp

    try:
        if args.compare_llamacpp:
            from bench.serving_compare import compare

            records = asyncio.run(compare(args))
        else:
            records = [asyncio.run(run(args))]
    except (aiohttp.ClientError, OSError, RuntimeError) as exc:
        print(f"sluice bench serving: error: {exc}", file=sys.stderr)
        return 1
    return 0 if all(r["failed"] == 0 for r in records) else 1
