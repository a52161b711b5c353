"""The CUDA path on a machine without CUDA: it imports, refuses clearly, and its
host-side logic (page tables, CUDA-graph buckets and padding, memory defaults) is
checked here, against a reference FlashInfer written in torch (tests/gpu/__init__.py).
The same checks against the real kernels are in tests/gpu/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from kernels.attention import create_attention_backend
from kernels.attention import flashinfer_backend as fib
from kernels.attention.flashinfer_backend import (
    FlashInferBackend,
    FlashInferUnavailable,
    gather_kv_indices,
    padded_seq_lens,
    paged_kv_layout,
    qo_indptr,
)
from runtime.model_executor.cuda_graph_runner import CudaGraphRunner, cuda_graph_batch_sizes, padding_waste, pick_bucket
from runtime.model_executor.gpu_defaults import GiB, default_cuda_graph_max_bs, default_max_running_requests, gpu_memory_defaults, kv_pool_tokens
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import load_model
from bench.paged_rounds import PagedRequests
from tests.gpu import fake_flashinfer, run_rounds

ROOT = Path(__file__).resolve().parents[1]


# --- imports and refusals ----------------------------------------------------------------------


def test_cuda_modules_import_without_flashinfer_or_cuda() -> None:
    code = (
        "import sys, kernels.attention.flashinfer_backend, runtime.model_executor.cuda_graph_runner, runtime.model_executor.gpu_defaults\n"
        "assert 'flashinfer' not in sys.modules, 'flashinfer imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_flashinfer_backend_without_cuda_says_what_to_do() -> None:
    with pytest.raises(FlashInferUnavailable, match="needs a CUDA device.*attention_backend=torch"):
        create_attention_backend("flashinfer", "cpu", num_qo_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(FlashInferUnavailable, match="CUDA"):
        FlashInferBackend("cuda", num_qo_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        CudaGraphRunner(torch.nn.Identity(), object(), None, torch.zeros(2, 8, dtype=torch.int32), max_bs=4)  # type: ignore[arg-type]


# --- page-table arithmetic -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seq_lens", "page_size", "indptr", "last"),
    [
        ([1, 16, 17, 33], 16, [0, 1, 2, 4, 7], [1, 16, 1, 1]),
        ([5, 1, 3], 1, [0, 5, 6, 9], [1, 1, 1]),
        ([4, 8, 9], 4, [0, 1, 3, 6], [4, 4, 1]),
        ([], 16, [0], []),
    ],
)
def test_paged_kv_layout(seq_lens: list[int], page_size: int, indptr: list[int], last: list[int]) -> None:
    got_indptr, got_last = paged_kv_layout(torch.tensor(seq_lens, dtype=torch.int64), page_size)
    assert got_indptr.dtype == got_last.dtype == torch.int32
    assert got_indptr.tolist() == indptr and got_last.tolist() == last


def test_qo_indptr_and_padding() -> None:
    assert qo_indptr([3, 1, 2]).tolist() == [0, 3, 4, 6]
    assert padded_seq_lens([7, 9], 4) == [7, 9, 1, 1]
    assert padded_seq_lens([7, 9], 2) == [7, 9]
    with pytest.raises(AssertionError):
        padded_seq_lens([1, 2, 3], 2)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_gather_kv_indices_matches_a_loop_over_requests(page_size: int) -> None:
    gen = torch.Generator().manual_seed(page_size)
    rows_total, ctx = 6, 64
    pages = (torch.randperm(rows_total * ctx // page_size, generator=gen) + 1).view(rows_total, -1)
    table = (pages.repeat_interleave(page_size, dim=1) * page_size + torch.arange(ctx) % page_size).to(torch.int32)
    rows = [4, 0, 5, 2]
    seq = [1, page_size * 2, 37, 64]
    indptr, _ = paged_kv_layout(torch.tensor(seq), page_size)
    got = gather_kv_indices(table, torch.tensor(rows), indptr, int(indptr[-1]), page_size)
    want = [int(pages[r, j]) for r, s in zip(rows, seq) for j in range(-(-s // page_size))]
    assert got.dtype == torch.int32 and got.tolist() == want


# --- CUDA-graph buckets and GPU memory defaults ---------------------------------------------------


def test_cuda_graph_buckets_follow_sglang_and_cover_max_bs() -> None:
    assert cuda_graph_batch_sizes(64) == [1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64]
    assert cuda_graph_batch_sizes(5) == [1, 2, 4, 5]
    assert cuda_graph_batch_sizes(1) == [1]
    big = cuda_graph_batch_sizes(600)
    assert big[-4:] == [512, 544, 576, 600] and 272 in big and 496 in big and 264 not in big
    assert cuda_graph_batch_sizes(100)[-2:] == [96, 100]
    assert padding_waste(cuda_graph_batch_sizes(256)) < 0.4
    buckets = cuda_graph_batch_sizes(64)
    assert [pick_bucket(buckets, b) for b in (1, 3, 4, 5, 13, 57, 64)] == [1, 4, 4, 8, 16, 64, 64]
    with pytest.raises(ValueError, match="no CUDA-graph bucket"):
        pick_bucket(buckets, 65)


@pytest.mark.parametrize(
    ("gib", "chunk", "graph_bs", "fraction"),
    [
        (16, 2048, 8, 0.772),  # T4: (16384 - 512 - 3072 - 16 - 128) / 16384 MiB
        (24, 2048, 24, 0.847),
        (40, 4096, 32, 0.833),
        (80, 8192, 256, 0.836),  # H100: 512 + 12288 + 512 + 128 = 13440 MiB reserved
        (141, 8192, 256, 0.907),  # H200: the same 13440 MiB of a larger card
        (192, 16384, 512, 0.867),
    ],
)
def test_gpu_memory_defaults_by_tier(gib: int, chunk: int, graph_bs: int, fraction: float) -> None:
    d = gpu_memory_defaults(gib * GiB)
    assert (d.chunked_prefill_size, d.cuda_graph_max_bs) == (chunk, graph_bs)
    assert d.mem_fraction_static == pytest.approx(fraction, abs=1e-3)


def test_gpu_memory_defaults_keep_what_the_user_set() -> None:
    d = gpu_memory_defaults(80 * GiB, chunked_prefill_size=-1, cuda_graph_max_bs=8, mem_fraction_static=0.5)
    assert (d.chunked_prefill_size, d.cuda_graph_max_bs, d.mem_fraction_static) == (-1, 8, 0.5)
    # Chunking off: the reserve is sized by max_prefill_tokens instead.
    small = gpu_memory_defaults(24 * GiB, chunked_prefill_size=-1, max_prefill_tokens=16384)
    assert small.mem_fraction_static < gpu_memory_defaults(24 * GiB).mem_fraction_static


def test_kv_pool_tokens_is_what_the_static_fraction_leaves_after_weights() -> None:
    total, weights = 80 * GiB, 16 * GiB
    per_token = 128 * 1024  # Llama-3-8B bf16: 2 * 32 layers * 8 heads * 128 * 2 bytes
    free = total - weights - 1 * GiB  # weights + CUDA context already resident
    tokens = kv_pool_tokens(free, total, 0.88, per_token, page_size=16)
    assert tokens == (int(0.88 * 80 * GiB) - 17 * GiB) // per_token // 16 * 16
    assert tokens % 16 == 0
    assert kv_pool_tokens(free, total, 0.1, per_token, 1) == 0  # weights alone exceed the fraction


def test_request_pool_defaults() -> None:
    assert default_max_running_requests(400_000, 8192) == 4096
    assert default_max_running_requests(20_000, 8192) == 2048
    assert default_max_running_requests(3000, 8192) == 1500  # at most half the KV tokens
    assert default_max_running_requests(2_000_000, 131072) == 1024  # int32 table capped at 512 MiB
    assert default_cuda_graph_max_bs(256, 48) == 48 and default_cuda_graph_max_bs(256, 4096) == 256


# --- the backend and the graph runner against a reference FlashInfer -----------------------------------


@pytest.fixture
def fake_fi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer())
    monkeypatch.setattr(fib, "check_cuda_device", lambda device: None)


def tiny_llama(tmp_path: Path, heads: int, kv_heads: int) -> tuple[ModelConfig, torch.nn.Module]:
    LlamaConfig(
        vocab_size=96, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=256, rms_norm_eps=1e-5,
    ).save_pretrained(tmp_path)  # fmt: skip
    config = ModelConfig.from_pretrained(tmp_path, torch.bfloat16)
    return config, load_model(tmp_path, config, "dummy", "cpu", seed=3)


def make_backend(config: ModelConfig, page_size: int) -> FlashInferBackend:
    return FlashInferBackend("cpu", config.num_heads, config.num_kv_heads, config.head_dim, page_size, config.dtype, workspace_bytes=16)


SEQS = [list(range(3, 3 + 40)), list(range(50, 59)), [7, 8, 9, 10, 11, 12]]
ROUNDS = [[30, 8, 0], [8, 1, 5], [1, 0, 1], [1, 0, 0]]  # extend; extend over a prefix + mixed decode; decodes


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (8, 2)])  # GQA 2: CUDA-core decode; GQA 4: tensor cores
def test_backend_logits_match_torch_native(fake_fi: None, tmp_path: Path, page_size: int, heads: int, kv_heads: int) -> None:
    config, model = tiny_llama(tmp_path, heads, kv_heads)
    backend = make_backend(config, page_size)
    assert backend.use_tensor_cores == (heads // kv_heads >= 4)
    ours = run_rounds(model, PagedRequests(config, 3, page_size=page_size, backend=backend, seed=0), SEQS, ROUNDS)
    ref = run_rounds(model, PagedRequests(config, 3, seed=0), SEQS, ROUNDS)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=0.03 * b.abs().max().item(), rtol=0.0)
    assert backend.prefill.plans == 2 and backend.decode.plans == 2  # one plan per batch, not per layer


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_runner_padding_matches_eager(fake_fi: None, tmp_path: Path, page_size: int) -> None:
    """The graph path without graphs (use_graphs=False): static buffers, padding to a
    bucket, re-planning; batch sizes 3 -> bucket 4, 5 -> 8, then 3 again (stale padding)."""
    config, model = tiny_llama(tmp_path, 4, 2)
    n = 5
    seqs = [[(11 * i + 5 * j) % 90 + 1 for j in range(20)] for i in range(n)]
    rounds = [[10, 7, 9, 12, 8], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    rounds.append([20 - sum(r[i] for r in rounds) for i in range(n)])  # finish with an extend

    eager = PagedRequests(config, n, page_size=page_size, backend=make_backend(config, page_size), seed=0)
    ref = run_rounds(model, eager, seqs, rounds)

    backend = make_backend(config, page_size)
    graphed = PagedRequests(config, n, page_size=page_size, backend=backend, seed=0)
    runner = CudaGraphRunner(model, backend, graphed.pool, graphed.req_to_token, max_bs=8, use_graphs=False)
    runner.capture()
    assert sorted(backend.graph_wrappers) == [1, 2, 4, 8]
    ours = run_rounds(model, graphed, seqs, rounds, graph_runner=runner)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-2 * b.abs().max().item(), rtol=0.0)
    # Padding wrote only to the dummy page: every live slot holds what the eager run wrote.
    p = page_size
    for layer in range(config.num_layers):
        assert torch.equal(graphed.pool.k_buffer[layer][p:], eager.pool.k_buffer[layer][p:])
        assert torch.equal(graphed.pool.v_buffer[layer][p:], eager.pool.v_buffer[layer][p:])
    assert backend.graph_wrappers[4].plans >= 3 and backend.graph_wrappers[8].plans == 2
