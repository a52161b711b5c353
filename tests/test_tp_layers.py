"""Tensor parallelism, the model side: a model split over two ranks computes what the
whole model computes, and each rank reads only its own slices of the weights.

The forward tests spawn two processes that join a gloo group on 127.0.0.1 and run
each tiny model through prefill, a mixed extend+decode round and decodes (the torch
attention backend, a KV pool per rank holding that rank's kv heads); the TP=1
reference runs in the test process on the same weights. The loading tests build each
rank's shard in this process (the rank is set by hand: loading runs no collective).
"""

from __future__ import annotations

import dataclasses
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from runtime.distributed import parallel_state
from runtime.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from runtime.layers.linear import kv_heads_per_rank
from runtime.layers.vocab_embedding import VocabParallelEmbedding
from runtime.layers.weights import LazyWeight
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import load_model
from tests.test_models import LLAMA3_ROPE, randomize, run_in_rounds

TP = 2
SEED = 11
BASE: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=256, rms_norm_eps=1e-5)  # fmt: skip
# Each case is (config, load format). 4 q heads over 2 ranks; kv heads equal to
# tp_size (one per rank) or fewer (the one kv head replicated on both ranks).
CASES: dict[str, tuple[PretrainedConfig, str]] = {
    "llama3-kv2": (LlamaConfig(**BASE, vocab_size=128, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE), "dummy"),
    # tied embeddings over a vocab tp_size does not divide; o_proj's bias after the all-reduce
    "llama-kv1-tied-bias": (
        LlamaConfig(**BASE, vocab_size=131, num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True),
        "dummy",
    ),
    "qwen2-kv2-tied": (Qwen2Config(**BASE, vocab_size=128, num_key_value_heads=2, tie_word_embeddings=True), "dummy"),
    "qwen3-kv1": (Qwen3Config(**BASE, vocab_size=131, num_key_value_heads=1, head_dim=32), "dummy"),
    "qwen3-kv2-safetensors": (Qwen3Config(**BASE, vocab_size=131, num_key_value_heads=2, head_dim=32), "auto"),
}
_gen = torch.Generator().manual_seed(3)
SEQS = [torch.randint(0, 128, (n,), generator=_gen).tolist() for n in (40, 10)]
# prefill both; `a` extends over its cached prefix while `b` decodes; then decodes
ROUNDS = [[30, 8], [8, 1], [1, 1], [1, 0]]
# float32; the sums over ranks reorder the matmul reductions and nothing else
ATOL, RTOL = 1e-5, 1e-4


def write_case(path: Path, config: PretrainedConfig, load_format: str) -> None:
    if load_format == "dummy":
        config.save_pretrained(path)  # config only
        return
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf, seed=1)
    hf.save_pretrained(path)


def run_case(path: Path, load_format: str) -> list[torch.Tensor]:
    config = ModelConfig.from_pretrained(path, torch.float32)
    model = load_model(path, config, load_format, "cpu", seed=SEED)
    return run_in_rounds(model, config, SEQS, ROUNDS)


def _rank_main(rank: int, init_method: str, workdir: str) -> None:
    """One TP rank: every case's logits to `rank{rank}.pt`, or a traceback to `.err`."""
    try:
        torch.set_num_threads(1)
        init_tensor_parallel(rank, TP, init_method, torch.device("cpu"), timeout_s=60)
        out = {name: run_case(Path(workdir) / name, fmt) for name, (_, fmt) in CASES.items()}
        torch.save(out, Path(workdir) / f"rank{rank}.pt")
    except BaseException:
        (Path(workdir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        destroy_tensor_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(workdir: Path, timeout_s: float = 120.0) -> None:
    """Run `_rank_main` on TP spawned processes; the first failure (or the timeout)
    terminates the rest, so no rank is left waiting in a collective."""
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, init_method, str(workdir)), daemon=True) for r in range(TP)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        pending = list(procs)
        while pending and time.monotonic() < deadline:
            wait([p.sentinel for p in pending], timeout=deadline - time.monotonic())
            for p in [p for p in pending if p.exitcode is not None]:
                pending.remove(p)
                if p.exitcode != 0:
                    pending = []
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: (workdir / f"rank{r}.err") for r in range(TP)}
    report = "\n".join(f"rank {r}:\n{e.read_text()}" for r, e in errors.items() if e.is_file())
    codes = [p.exitcode for p in procs]
    assert codes == [0] * TP, f"rank exit codes {codes} (negative: killed, e.g. at the {timeout_s}s timeout)\n{report}"


@pytest.fixture(scope="module")
def tp_logits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[torch.Tensor], ...]]:
    """case -> (TP=1 logits, rank 0's TP=2 logits, rank 1's), per sequence."""
    workdir = tmp_path_factory.mktemp("tp")
    for name, (config, fmt) in CASES.items():
        write_case(workdir / name, config, fmt)
    spawn_ranks(workdir)
    ranks = [torch.load(workdir / f"rank{r}.pt") for r in range(TP)]
    return {name: (run_case(workdir / name, fmt), *(r[name] for r in ranks)) for name, (_, fmt) in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_equal_tp1_on_every_rank(case: str, tp_logits: dict[str, tuple[list[torch.Tensor], ...]]) -> None:
    tp1, rank0, rank1 = tp_logits[case]
    vocab = CASES[case][0].vocab_size
    for ref, ours, other in zip(tp1, rank0, rank1, strict=True):
        assert ours.dtype == torch.float32 and ours.shape == (ref.shape[0], vocab)
        assert torch.equal(ours, other), "every rank gets the same full logits"
        torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# --- loading: each rank reads only its slices, and they tile the TP=1 weights -----------


@contextmanager
def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> Iterator[None]:
    """Build modules as rank `rank` of `size` (no process group: construction and
    loading run no collective)."""
    with monkeypatch.context() as m:
        m.setattr(parallel_state, "_TP", dataclasses.replace(parallel_state._TP, rank=rank, size=size))
        yield


def load_counting_reads(monkeypatch: pytest.MonkeyPatch, path: Path, fmt: str) -> tuple[dict[str, torch.Tensor], int]:
    """A model's parameters, and how many checkpoint elements loading read."""
    read = 0
    materialize = LazyWeight.materialize

    def counting(self: LazyWeight) -> torch.Tensor:
        nonlocal read
        t = materialize(self)
        read += t.numel()
        return t

    with monkeypatch.context() as m:
        m.setattr(LazyWeight, "materialize", counting)
        model = load_model(path, ModelConfig.from_pretrained(path, torch.float32), fmt, "cpu", seed=SEED)
    own = sum(p.numel() for p in model.parameters())
    padding = sum(
        (m.num_embeddings_per_partition - (m.vocab_end_index - m.vocab_start_index)) * m.weight.shape[1]
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding)
    )
    assert read == own - padding, "a rank reads exactly the checkpoint elements its parameters hold"
    return dict(model.named_parameters()), read


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("fmt", ["auto", "dummy"])
def test_rank_shards_are_slices_of_the_tp1_weights(
    fmt: str, kv_heads: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab, hidden, heads, head_dim, inter = 131, 64, 4, 32, 96
    write_case(tmp_path, Qwen3Config(**BASE, vocab_size=vocab, num_key_value_heads=kv_heads, head_dim=head_dim), fmt)
    full, full_read = load_counting_reads(monkeypatch, tmp_path, fmt)
    shards = []
    for rank in range(TP):
        with as_rank(monkeypatch, rank, TP):
            params, read = load_counting_reads(monkeypatch, tmp_path, fmt)
        assert read < 0.6 * full_read
        shards.append(params)

    q, kv = heads * head_dim, kv_heads * head_dim
    q_r, kv_r = q // TP, kv_heads_per_rank(kv_heads, TP) * head_dim
    for layer in range(2):
        pre = f"model.layers.{layer}"
        fq, fk, fv = full[f"{pre}.self_attn.qkv_proj.weight"].split((q, kv, kv))
        fgate, fup = full[f"{pre}.mlp.gate_up_proj.weight"].chunk(2)
        for rank, s in enumerate(shards):
            sq, sk, sv = s[f"{pre}.self_attn.qkv_proj.weight"].split((q_r, kv_r, kv_r))
            assert torch.equal(sq, fq[rank * q_r : (rank + 1) * q_r])
            kv_start = rank * kv_heads // TP * head_dim  # replicated when kv_heads < TP
            assert torch.equal(sk, fk[kv_start : kv_start + kv_r]) and torch.equal(sv, fv[kv_start : kv_start + kv_r])
            gate, up = s[f"{pre}.mlp.gate_up_proj.weight"].chunk(2)
            rows = slice(rank * inter // TP, (rank + 1) * inter // TP)
            assert torch.equal(gate, fgate[rows]) and torch.equal(up, fup[rows])
            for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
                assert torch.equal(s[f"{pre}.{norm}.weight"], full[f"{pre}.{norm}.weight"])
        for row_parallel in ("self_attn.o_proj", "mlp.down_proj"):
            name = f"{pre}.{row_parallel}.weight"
            assert torch.equal(torch.cat([s[name] for s in shards], dim=1), full[name])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        stacked = torch.cat([s[name] for s in shards])
        assert stacked.shape == (2 * 66, hidden)  # ceil(131 / 2) rows per rank
        assert torch.equal(stacked[:vocab], full[name]) and not stacked[vocab:].any()


def test_kv_heads_split_or_replicate() -> None:
    assert [kv_heads_per_rank(kv, tp) for kv, tp in [(8, 2), (2, 2), (1, 2), (2, 4), (8, 1), (4, 8)]] == [4, 1, 1, 1, 8, 1]
    for kv, tp in [(3, 2), (2, 3), (4, 6)]:
        with pytest.raises(ValueError, match=f"tp_size={tp} must divide num_key_value_heads={kv}"):
            kv_heads_per_rank(kv, tp)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [(4, 2, 3, "tp_size=3 must divide num_attention_heads=4"), (12, 3, 4, "num_key_value_heads=3")],
)
def test_tp_size_that_does_not_fit_the_heads_is_refused_at_build(
    heads: int, kv_heads: int, tp: int, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = {**BASE, "num_attention_heads": heads, "hidden_size": 8 * heads, "intermediate_size": 96}
    LlamaConfig(**fields, vocab_size=128, num_key_value_heads=kv_heads).save_pretrained(tmp_path)
    with as_rank(monkeypatch, 0, tp), pytest.raises(ValueError, match=message):
        load_model(tmp_path, ModelConfig.from_pretrained(tmp_path, torch.float32), "dummy", "cpu", seed=SEED)
