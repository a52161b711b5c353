"""`sluice bench embeddings`: embeddings per second of an embedding server, at several batch sizes.

In-process (an Engine built with --is-embedding from the engine flags; default model: the
embedded SmolLM2), or over HTTP with --url (POST /v1/embeddings to a running
`sluice serve --is-embedding`). A batch of B is B inputs sent together: one
Engine.encode of a list, or one request with B inputs; the scheduler packs them into
prefill batches under --max-prefill-tokens and --chunked-prefill-size. Batches of one
size run back to back until --inputs-per-size inputs are embedded. Every input is fresh
random token ids, so no radix-cache hit makes a batch cheaper.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.engine_runs import add_engine_arguments, close_engine, engine_settings, make_engine
from bench.metrics import save_records

FIRST_PLAIN_TOKEN = 17  # ids below are the default tokenizer's special tokens
Embed = Callable[[list[list[int]]], int]  # embeds a batch; returns how many vectors came back


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64], help="Inputs sent together (B).")
    parser.add_argument("--input-len", type=int, default=128, help="Tokens per input.")
    parser.add_argument("--inputs-per-size", type=int, default=128, help="Inputs embedded (timed) per batch size.")
    parser.add_argument("--warmup-batches", type=int, default=1, help="Untimed batches per batch size first.")
    parser.add_argument("--url", default=None, help="Benchmark this server's /v1/embeddings instead of an in-process Engine.")
    parser.add_argument("--vocab-size", type=int, default=49152, help="With --url: token ids are drawn below this.")
    parser.add_argument("--seed", type=int, default=1, help="Seed of the random inputs.")
    parser.add_argument("--output-file", default=None, help="Append one JSON line per batch size.")
    add_engine_arguments(parser)


def _measure(embed: Embed, batch: int, args: argparse.Namespace, vocab: int, rng: random.Random) -> dict[str, Any]:
    def inputs() -> list[list[int]]:
        return [[rng.randrange(FIRST_PLAIN_TOKEN, vocab) for _ in range(args.input_len)] for _ in range(batch)]

    for _ in range(args.warmup_batches):
        embed(inputs())
    latencies = []
    for _ in range(max(1, args.inputs_per_size // batch)):
        todo = inputs()
        start = time.perf_counter()
        got = embed(todo)
        latencies.append(time.perf_counter() - start)
        assert got == batch, f"{got} vectors for {batch} inputs"
    total = sum(latencies)
    n = batch * len(latencies)
    return {
        "batch_size": batch,
        "input_len": args.input_len,
        "inputs": n,
        "seconds": total,
        "embeddings_per_s": n / total,
        "input_tokens_per_s": n * args.input_len / total,
        "median_batch_latency_s": statistics.median(latencies),
    }


def _in_process(args: argparse.Namespace) -> tuple[Embed, int, Callable[[], None], str]:
    settings = engine_settings(args, is_embedding=True)
    engine = make_engine(settings)

    def embed(batch: list[list[int]]) -> int:
        outs = engine.encode(batch) if len(batch) > 1 else [engine.encode(batch[0])]
        return sum(1 for o in outs if o["embedding"] is not None)

    desc = f"in-process engine, pooling={engine.settings.pooling}, dtype={str(engine.model_config.dtype).removeprefix('torch.')}"
    return embed, int(engine.model_config.vocab_size), lambda: close_engine(engine), desc


def _over_http(args: argparse.Namespace) -> tuple[Embed, int, Callable[[], None], str]:
    import httpx

    client = httpx.Client(base_url=args.url, timeout=600)

    def embed(batch: list[list[int]]) -> int:
        r = client.post("/v1/embeddings", json={"input": batch})
        r.raise_for_status()
        return len(r.json()["data"])

    return embed, args.vocab_size, client.close, f"POST {args.url}/v1/embeddings"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    embed, vocab, close, desc = _over_http(args) if args.url else _in_process(args)
    rng = random.Random(args.seed)
    try:
        records = [{**_measure(embed, b, args, vocab, rng), "target": desc} for b in args.batch_sizes]
    finally:
        close()
    print(f"{desc}; {args.input_len} tokens per input")
    print(f"{'batch':>6} {'inputs':>7} {'embeddings/s':>13} {'input tok/s':>12} {'median batch s':>15}")
    for r in records:
        print(f"{r['batch_size']:>6} {r['inputs']:>7} {r['embeddings_per_s']:>13.2f} {r['input_tokens_per_s']:>12.1f} "
              f"{r['median_batch_latency_s']:>15.3f}")
    save_records(args.output_file, "embeddings", records, args)
    return records


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
