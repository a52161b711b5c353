"""The bench tools run end to end on a tiny dummy-weight model and report sane numbers:
every request succeeds, token counts are exact, TTFT <= E2E. No timing assertions."""

from __future__ import annotations

import argparse
import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.datasets import TokenSampler, build_requests, exact_text
from bench.metrics import RequestResult, compute_metrics, format_report
from tests.server_helpers import ServerProcess

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
ENGINE_FLAGS = ["--load-format", "dummy", "--max-total-tokens", "8192", "--max-running-requests", "16", "--dtype", "float32"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A 2-layer Llama config with the default model's (SmolLM2) tokenizer, no weights."""
    out = tmp_path_factory.mktemp("tiny-llama")
    (out / "config.json").write_text(json.dumps(TINY_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def tiny_server_process(tiny_model: Path) -> Iterator[ServerProcess]:
    """A `sluice serve` of the tiny model with dummy weights, started (not yet ready)."""
    server = ServerProcess("--model-path", str(tiny_model), "--load-format", "dummy", "--max-running-requests", "16").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def start_tiny_server_early(request: pytest.FixtureRequest) -> None:
    """When this run includes the serving tests, their server starts with the module
    and loads while the in-process tests run."""
    selected = (item for item in request.session.items if item.path == request.path)
    if any("tiny_server" in getattr(item, "fixturenames", ()) for item in selected):
        request.getfixturevalue("tiny_server_process")


def parse(*argv: str) -> argparse.Namespace:
    """Through the real `sluice` parser, so registration is tested too."""
    from app.cli import build_parser

    return build_parser().parse_args(["bench", *argv])


# ---- datasets and report ----------------------------------------------------------------


def test_random_prompts_have_exact_lengths_and_no_special_tokens(tokenizer: Any) -> None:
    ns = parse("offline", "--num-prompts", "20", "--random-input-len", "64", "--random-output-len", "16", "--random-range-ratio", "0.5")
    reqs = build_requests(ns, tokenizer)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    assert len(reqs) == 20
    assert all(32 <= r.prompt_len <= 64 and 8 <= r.output_len <= 16 for r in reqs)
    assert not any(t in special for r in reqs for t in r.prompt_ids)
    fixed = build_requests(parse("offline", "--num-prompts", "3", "--random-input-len", "40"), tokenizer)
    assert [r.prompt_len for r in fixed] == [40, 40, 40]


def test_shared_prefix_groups_share_their_system_prompt(tokenizer: Any) -> None:
    ns = parse("offline", "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4",
               "--gsp-system-prompt-len", "50", "--gsp-question-len", "10", "--gsp-output-len", "5")
    reqs = build_requests(ns, tokenizer)
    assert len(reqs) == 12 and all(r.prompt_len == 60 and r.output_len == 5 for r in reqs)
    for g in range(3):
        members = [r for r in reqs if r.group == g]
        assert len(members) == 4 and len({tuple(r.prompt_ids[:50]) for r in members}) == 1
    assert len({tuple(r.prompt_ids[:50]) for r in reqs}) == 3


def test_chat_text_re_encodes_to_the_exact_count(tokenizer: Any) -> None:
    sampler = TokenSampler(tokenizer, random.Random(0))
    for n in (1, 17, 200):
        text, count = exact_text(tokenizer, sampler.sample(n), sampler)
        assert count == n == len(tokenizer.encode(text, add_special_tokens=False))


def test_report_has_sglang_blocks_and_metric_definitions() -> None:
    results = [RequestResult(True, 10, 4, 4, ttft=0.1, latency=0.4, itl=[0.1, 0.1, 0.1]), RequestResult(error="boom")]
    m = compute_metrics(results, duration=1.0)
    assert m["completed"] == 1 and m["failed"] == 1 and m["total_output_tokens"] == 4
    assert m["mean_tpot_ms"] == pytest.approx(100.0) and m["median_itl_ms"] == pytest.approx(100.0)
    text = format_report(m, [("Backend:", "sluice")])
    for heading in ("Serving Benchmark Result", "Successful requests:", "Time to First Token", "Inter-token Latency",
                    "Time per Output Token (excl. 1st token)", "End-to-end Latency", "Failed requests:"):
        assert heading in text


# ---- engine tools -----------------------------------------------------------------------------


def test_offline_with_variant_and_hf_counts_every_token(tiny_model: Path, tmp_path: Path) -> None:
    from bench import offline

    out = tmp_path / "offline.jsonl"
    ns = parse("offline", "--model-path", str(tiny_model), *ENGINE_FLAGS, "--num-prompts", "6", "--random-input-len", "24",
               "--random-output-len", "8", "--random-range-ratio", "0.5", "--ab", "disable_overlap_schedule=true",
               "--compare-hf", "--hf-batch-size", "4", "--disable-tqdm", "--output-file", str(out))
    records = offline.run(ns)
    sluice, no_overlap, hf = records
    expected = sluice["total_output_tokens"]
    for r in (sluice, no_overlap):
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_len_mismatches"] == 0
        assert r["total_output_tokens"] == expected and r["output_throughput"] > 0
        assert 0 < r["median_ttft_ms"] <= r["median_e2e_ms"]
    assert hf["total_output_tokens"] == expected and hf["sluice_over_hf_output_throughput"] > 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["tool"] for line in lines] == ["offline", "offline", "hf"] and lines[0]["args"]["num_prompts"] == 6


def test_offline_stream_measures_ttft_and_itl_and_counts_shared_prefix_hits(tiny_model: Path) -> None:
    from bench import offline

    # One request at a time: in each group of 3, the first computes the 64-token
    # system prompt and the other two find it in the prefix cache.
    ns = parse("offline", "--model-path", str(tiny_model), *ENGINE_FLAGS, "--max-running-requests", "1", "--stream",
               "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
               "--gsp-system-prompt-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "6", "--disable-tqdm")
    (r,) = offline.run(ns)
    assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 36 and r["total_input_tokens"] == 6 * 72
    assert r["mean_ttft_ms"] <= r["mean_e2e_ms"] and r["max_ttft_ms"] <= r["max_e2e_ms"]
    assert r["median_itl_ms"] > 0
    assert r["total_cached_tokens"] == 2 * 2 * 64 == r["server_info"]["cached_tokens_total"]


def test_one_batch_reports_prefill_and_decode(tiny_model: Path) -> None:
    from bench import one_batch

    ns = parse("one-batch", "--model-path", str(tiny_model), *ENGINE_FLAGS, "--batch-size", "1", "3", "--input-len", "16", "--output-len", "5")
    records = one_batch.run(ns)
    assert [r["batch_size"] for r in records] == [1, 3]
    for r in records:
        assert r["failed"] == 0 and r["prefill_forwards"] == 1 and r["decode_steps"] >= 3
        assert r["prefill_latency_s"] > 0 and r["decode_median_latency_s"] > 0 and r["engine_batch_ttft_s"] <= r["total_latency_s"]


def test_decode_step_times_a_batch_whose_prompts_exceed_one_prefill_chunk(tiny_model: Path) -> None:
    """8 x 400 prompt tokens span 4 chunks of the default chunked_prefill_size: chunked, the
    first requests would finish before the last joined and no 8-row decode batch would run."""
    from bench import decode_step

    flags = [a for a in ENGINE_FLAGS if a not in ("--max-running-requests", "16")]
    ns = parse("decode-step", "--model-path", str(tiny_model), *flags, "--batch-size", "8", "--input-len", "400",
               "--iters", "2", "--rounds", "1", "--variants", "eager", "fused")  # fmt: skip
    record = decode_step.run(ns)
    assert record["batch_size"] == 8 and record["eager_median_ms"] > 0 and record["fused_median_ms"] > 0


@pytest.mark.parametrize("unmarked", [False, True], ids=["marked", "unmarked"])
def test_multi_turn_shows_what_deterministic_inference_shares(tiny_model: Path, unmarked: bool) -> None:
    """A next turn's cache hit is the earlier prompt and its answer (less the answer's last
    token, which has no KV yet); under deterministic inference too when the turn marks its
    earlier answers, else the earlier prompt only."""
    from bench import multi_turn

    ns = parse("multi-turn", "--model-path", str(tiny_model), *ENGINE_FLAGS, "--conversations", "1", "--turns", "3",
               "--first-len", "20", "--user-len", "4", "--answer-len", "6", "--ab", "enable_deterministic_inference=true",
               *(["--unmarked-answers"] if unmarked else []))  # fmt: skip
    base, det = multi_turn.run(ns)
    assert base["cached_tokens"] == {"0": [0], "1": [20 + 6 - 1], "2": [30 + 6 - 1]}
    assert det["cached_tokens"] == ({"0": [0], "1": [20], "2": [30]} if unmarked else base["cached_tokens"])
    assert all(len(v) == 1 and v[0] > 0 for r in (base, det) for v in r["ttft_s"].values())


def test_multi_turn_cold_serves_every_turn_from_an_empty_cache(tiny_model: Path) -> None:
    from bench import multi_turn

    ns = parse("multi-turn", "--model-path", str(tiny_model), *ENGINE_FLAGS, "--conversations", "1", "--turns", "3",
               "--first-len", "20", "--user-len", "4", "--answer-len", "6", "--cold")  # fmt: skip
    (base,) = multi_turn.run(ns)
    assert base["cached_tokens"] == {"0": [0], "1": [0], "2": [0]}
    assert all(len(v) == 1 and v[0] > 0 for v in base["ttft_s"].values())


def test_scheduler_overhead_runs_the_real_scheduler_at_each_n(tiny_model: Path) -> None:
    from bench import scheduler_overhead

    ns = parse("scheduler-overhead", "--num-running", "1", "8", "--rounds", "5", "--warmup-rounds", "2", "--input-len", "16",
               "--tokenizer", str(tiny_model))
    records = scheduler_overhead.run(ns)
    assert [r["num_running"] for r in records] == [1, 8]
    assert all(r["median_us_per_round"] > 0 and r["rounds"] == 5 for r in records)


def test_chunked_itl_compares_chunk_sizes(tiny_model: Path) -> None:
    from bench import chunked_itl

    ns = parse("chunked-itl", "--model-path", str(tiny_model), *ENGINE_FLAGS, "--chunk-sizes", "64", "-1", "--num-streams", "2",
               "--stream-input-len", "8", "--stream-output-len", "24", "--long-input-len", "300", "--long-output-len", "2",
               "--long-after-tokens", "4")
    records = chunked_itl.run(ns)
    assert [r["settings"]["chunked_prefill_size"] for r in records] == [64, -1]
    for r in records:
        assert r["failed"] == 0 and r["num_gaps"] == 2 * 23 and r["long_ttft_ms"] > 0 and r["p99_itl_ms"] >= r["median_itl_ms"]


# ---- serving against a real `sluice serve` -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tiny_server_process: ServerProcess) -> ServerProcess:
    return tiny_server_process.wait_ready()


@pytest.mark.parametrize("backend", ["sluice", "openai", "openai-chat"])
def test_serving_backends_report_exact_counts(backend: str, tiny_server: Any, tiny_model: Path, tmp_path: Path) -> None:
    import asyncio

    from bench import serving_client

    out = tmp_path / "serving.jsonl"
    ns = parse("serving", "--backend", backend, "--base-url", tiny_server.base_url, "--num-prompts", "5",
               "--random-input-len", "20", "--random-output-len", "7", "--max-concurrency", "2", "--request-rate", "50",
               "--disable-tqdm", "--output-file", str(out))
    r = asyncio.run(serving_client.run(ns))
    assert r["completed"] == 5 and r["failed"] == 0 and r["output_len_mismatches"] == 0
    assert r["total_output_tokens"] == 35
    if backend == "openai-chat":
        assert r["total_input_tokens"] > 100 and r["chat_text_misses"] == 0  # the chat template adds tokens
    else:
        assert r["total_input_tokens"] == 100
    assert 0 < r["mean_ttft_ms"] <= r["mean_e2e_ms"] and r["max_ttft_ms"] <= r["max_e2e_ms"]
    assert r["median_tpot_ms"] > 0 and r["median_itl_ms"] > 0
    line = json.loads(out.read_text())
    assert line["tool"] == "serving" and line["args"]["backend"] == backend


def test_decode_attention_times_every_variant(tmp_path: Path) -> None:
    from bench import decode_attention

    out = tmp_path / "attn.jsonl"
    ns = parse("decode-attention", "--batch-size", "4", "--context-len", "16", "--num-layers", "2", "--repeats", "2",
               "--output-file", str(out))
    assert decode_attention.main(ns) == 0
    record = json.loads(out.read_text().splitlines()[-1])
    assert set(record["median_ms"]) == {"kernel, float32 KV", "kernel, bfloat16 KV", "torch gather + SDPA, float32 KV"}
    assert all(v > 0 for v in record["median_ms"].values())


def test_serving_compare_llamacpp_sends_the_same_requests_to_both(
    tiny_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against a fake llama-server (tests/test_bench_llamacpp.py): both backends get the
    identical requests, both reports and the ratio table print, both records are saved
    tagged by engine, and the llama-server is gone afterwards."""
    from bench import serving
    from tests.test_bench_llamacpp import is_alive, recorded_starts, write_fake_llama_server

    starts = tmp_path / "starts.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_RECORD", str(starts))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "serving.jsonl"
    ns = parse("serving", "--base-url", tiny_server.base_url, "--num-prompts", "6", "--random-input-len", "20",
               "--random-output-len", "7", "--max-concurrency", "3", "--disable-tqdm", "--output-file", str(out),
               "--compare-llamacpp", str(write_fake_llama_server(tmp_path)), "--llamacpp-model", str(gguf))
    assert serving.main(ns) == 0
    text = capsys.readouterr().out
    assert "sluice vs llama.cpp" in text and "Output token throughput (tok/s)" in text and "Median ITL (ms)" in text
    sluice, llama = (json.loads(line) for line in out.read_text().splitlines())
    assert (sluice["engine"], llama["engine"]) == ("sluice", "llama.cpp")
    for r in (sluice, llama):
        assert r["tool"] == "serving" and r["args"]["compare_llamacpp"]
        assert r["completed"] == 6 and r["failed"] == 0 and r["output_len_mismatches"] == 0
        assert r["total_output_tokens"] == 42 and r["total_input_tokens"] == 120 and r["median_itl_ms"] > 0
    (start,) = recorded_starts(starts)
    argv = start["argv"]
    assert argv[argv.index("--parallel") + 1] == "3" and argv[argv.index("--model") + 1] == str(gguf)
    assert int(argv[argv.index("--ctx-size") + 1]) >= 3 * 27
    assert not is_alive(start["pid"])


def test_serving_compare_rounds_alternate_the_engines_on_fresh_requests(
    tiny_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--compare-rounds 2: sluice, llama.cpp, sluice, llama.cpp; each round's requests go
    to both engines, and round 2's are not round 1's (a llama-server's prompt cache would
    serve a repeated prompt); the summary gives each round's throughput ratio."""
    from bench import serving, serving_client
    from tests.test_bench_llamacpp import write_fake_llama_server

    sent: list[tuple[str, tuple[int, ...]]] = []
    real_send_one = serving_client.send_one

    async def spy(client: Any, backend: str, req: Any) -> Any:
        sent.append((backend, tuple(req.prompt_ids)))
        return await real_send_one(client, backend, req)

    monkeypatch.setattr(serving_client, "send_one", spy)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "serving.jsonl"
    ns = parse("serving", "--base-url", tiny_server.base_url, "--num-prompts", "4", "--random-input-len", "12",
               "--random-output-len", "3", "--max-concurrency", "2", "--disable-tqdm", "--output-file", str(out),
               "--compare-llamacpp", str(write_fake_llama_server(tmp_path)), "--llamacpp-model", str(gguf),
               "--compare-rounds", "2")
    assert serving.main(ns) == 0
    runs: list[tuple[str, set[tuple[int, ...]]]] = []  # consecutive sends to one engine
    for backend, prompt in sent:
        if not runs or runs[-1][0] != backend:
            runs.append((backend, set()))
        runs[-1][1].add(prompt)
    assert [b for b, _ in runs] == ["sluice", "openai", "sluice", "openai"]
    assert runs[0][1] == runs[1][1] and runs[2][1] == runs[3][1] and len(runs[0][1]) == 5  # 4 + the warm-up
    assert not runs[0][1] & runs[2][1]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["engine"], r["round"]) for r in records] == [("sluice", 0), ("llama.cpp", 0), ("sluice", 1), ("llama.cpp", 1)]
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in records)
    text = capsys.readouterr().out
    assert "medians of 2 rounds" in text
    (ratios,) = [line for line in text.splitlines() if line.startswith("Throughput ratio by round: ")]
    assert len(ratios.split(":")[1].split(",")) == 2
