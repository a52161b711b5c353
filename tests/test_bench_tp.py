"""`sluice bench all-reduce` runs end to end on two gloo ranks and a tiny TP=2 model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from bench.cli import main as bench_main
from tests.tiny_checkpoints import make_llama_checkpoint


def test_all_reduce_bench_reports_latencies_and_the_collective_share(tmp_path: Path, tokenizer: Any) -> None:
    ckpt = make_llama_checkpoint(tmp_path / "ck", tokenizer, num_kv_heads=2)
    out = tmp_path / "records.jsonl"
    code = bench_main([
        "all-reduce", "--tp-size", "2", "--sizes", "8", "4096", "--iters", "5", "--decode-steps", "4",
        "--model-path", str(ckpt), "--dtype", "float32", "--output-file", str(out),
    ])  # fmt: skip
    assert code == 0
    records = [orjson.loads(line) for line in out.read_text().splitlines()]
    latencies = [r for r in records if "elements" in r]
    assert [r["elements"] for r in latencies] == [8, 4096]
    assert all(r["sluice_median_us"] > 0 and r["torch.distributed_median_us"] > 0 for r in latencies)
    (share,) = [r for r in records if "collective_share_of_wall" in r]
    # Every TP step all-reduces: rank 0 must have spent some, but not more than all, of the time there.
    assert 0 < share["collective_s"] <= share["wall_s"] and share["tp_size"] == 2
