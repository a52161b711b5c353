"""CUDA graphs and overlap on a GPU: replays equal eager forwards, and the engine's
greedy outputs do not depend on graphs, overlap or mixed chunks; every KV slot and
request row comes back afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.attention.flashinfer_backend import FlashInferBackend
from runtime.model_executor.cuda_graph_runner import CudaGraphRunner
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import load_model
from tests.conftest import assert_all_memory_free
from bench.paged_rounds import PagedRequests
from tests.gpu import run_rounds, write_model_dir

pytestmark = pytest.mark.gpu

DEV = "cuda"
# A bf16 greedy token may differ between two kernel schedules only where the top two
# logprobs are this close (the reference's gap at the first divergence).
BF16_NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, torch.nn.Module]:
    path = write_model_dir(tmp_path_factory.mktemp("tiny-graph"), vocab_size=512)
    config = ModelConfig.from_pretrained(path, torch.bfloat16)
    return config, load_model(path, config, "dummy", DEV, seed=5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_replay_matches_eager_with_padding(tiny: tuple[ModelConfig, torch.nn.Module], page_size: int) -> None:
    """Batch sizes 3 -> bucket 4, 5 -> 8, then 3 again (stale padding rows), captured
    and replayed on a side stream, as the worker runs them."""
    config, model = tiny
    n = 5
    seqs = [[(11 * i + 5 * j) % 500 + 1 for j in range(20)] for i in range(n)]
    rounds = [[10, 7, 9, 12, 8], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    rounds.append([20 - sum(r[i] for r in rounds) for i in range(n)])

    def backend() -> FlashInferBackend:
        return FlashInferBackend(DEV, config.num_heads, config.num_kv_heads, config.head_dim, page_size, config.dtype)

    eager = PagedRequests(config, n, page_size=page_size, backend=backend(), device=DEV, seed=0)
    ref = run_rounds(model, eager, seqs, rounds)

    fi = backend()
    graphed = PagedRequests(config, n, page_size=page_size, backend=fi, device=DEV, seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    runner = CudaGraphRunner(model, fi, graphed.pool, graphed.req_to_token, max_bs=8, stream=stream)
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4, 8]
    with torch.cuda.stream(stream):
        ours = run_rounds(model, graphed, seqs, rounds, graph_runner=runner)
    torch.cuda.synchronize()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=0.03 * b.abs().max().item(), rtol=0.0)
    p = page_size  # padding wrote to the dummy page only
    for layer in range(config.num_layers):
        torch.testing.assert_close(graphed.pool.k_buffer[layer][p:], eager.pool.k_buffer[layer][p:], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(graphed.pool.v_buffer[layer][p:], eager.pool.v_buffer[layer][p:], atol=2e-2, rtol=2e-2)


# --- through the engine ----------------------------------------------------------------------

ENGINE: dict[str, Any] = dict(
    device="cuda", load_format="dummy", dtype="bfloat16", random_seed=0,
    max_total_tokens=16384, max_running_requests=32, cuda_graph_max_bs=16,
)  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "eager, no overlap": dict(disable_cuda_graph=True, disable_overlap_schedule=True),  # the reference
    "eager, overlap": dict(disable_cuda_graph=True),
    "graphs, no overlap": dict(disable_overlap_schedule=True),
    "graphs, overlap": {},
    "graphs, overlap, mixed chunks": dict(enable_mixed_chunk=True, chunked_prefill_size=64),
}


def workload() -> tuple[list[list[int]], list[dict[str, Any]]]:
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 49152, (n,), generator=gen).tolist()  # noqa: E731
    shared = ids(200)  # a radix-cached prefix: extends over a paged prefix
    prompts = [shared + ids(5), shared + ids(30)] + [ids(n) for n in (1, 7, 40, 300, 90, 12)]
    # Different lengths: the decode batch shrinks 8 -> 1 through several buckets.
    params = [dict(max_new_tokens=m, temperature=0.0, ignore_eos=True) for m in (24, 16, 32, 8, 20, 28, 4, 36)]
    return prompts, params


def assert_same_greedy(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    a, b = ref["output_ids"], got["output_ids"]
    assert len(a) == len(b), what
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return
    (lp0, _), (lp1, _) = ref["meta_info"]["output_top_logprobs"][j][:2]
    assert lp0 - lp1 < BF16_NEAR_TIE, f"{what}: token {j} differs ({a[j]} vs {b[j]}) with a top-2 gap of {lp0 - lp1:.3f}"


def run_variant(model_dir: Path, page_size: int, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    from runtime import Engine

    engine = Engine(model_path=str(model_dir), page_size=page_size, **{**ENGINE, **overrides})
    try:
        graph_runner = getattr(engine.worker, "graph_runner", None)
        replays = [0]
        if not overrides.get("disable_cuda_graph"):
            assert graph_runner is not None, "CUDA graphs are not wired into ModelRunner (see docs/gpu.md, the wiring patch)"
            replay = graph_runner.replay

            def counted(fb: Any) -> torch.Tensor:
                replays[0] += 1
                return replay(fb)

            graph_runner.replay = counted
        prompts, params = workload()
        outs = engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2)
        assert isinstance(outs, list)
        assert [len(o["output_ids"]) for o in outs] == [p["max_new_tokens"] for p in params]
        if graph_runner is not None:
            assert replays[0] > 0, "no decode step replayed a graph"
        assert_all_memory_free(engine)
        return outs
    finally:
        engine.shutdown()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_outputs_do_not_depend_on_graphs_overlap_or_mixing(tiny_model_dir: Path, page_size: int) -> None:
    results = {name: run_variant(tiny_model_dir, page_size, o) for name, o in VARIANTS.items()}
    ref = results["eager, no overlap"]
    for name, outs in results.items():
        for i, (r, o) in enumerate(zip(ref, outs)):
            assert_same_greedy(r, o, f"{name}, prompt {i}")


def test_engine_defaults_on_cuda_pick_flashinfer_bf16_and_graphs(tiny_model_dir: Path) -> None:
    from runtime import Engine

    engine = Engine(model_path=str(tiny_model_dir), load_format="dummy", max_total_tokens=8192)
    try:
        s = engine.settings
        assert (s.device, s.attention_backend) == ("cuda", "flashinfer")
        assert engine.model_config.dtype == torch.bfloat16
        assert s.cuda_graph_max_bs is not None and s.cuda_graph_max_bs <= (s.max_running_requests or 0)
        assert s.chunked_prefill_size in (2048, 4096, 8192, 16384)
        out = engine.generate([1, 2, 3], dict(max_new_tokens=4, temperature=0.0, ignore_eos=True))
        assert isinstance(out, dict) and len(out["output_ids"]) == 4
        assert_all_memory_free(engine)
    finally:
        engine.shutdown()


def test_a_second_engine_in_one_process_gets_the_memory_the_first_gave_back(tiny_model_dir: Path) -> None:
    """Offline users (and `sluice bench offline --ab`) build engines one after another:
    the KV pool is sized from free GPU memory, so the first engine's must be free."""
    from runtime import Engine

    sizes = []
    for _ in range(2):
        engine = Engine(model_path=str(tiny_model_dir), load_format="dummy")
        try:
            sizes.append(engine.pools.max_total_num_tokens)
            out = engine.generate([1, 2, 3], dict(max_new_tokens=4, temperature=0.0, ignore_eos=True))
            assert isinstance(out, dict) and len(out["output_ids"]) == 4
        finally:
            engine.shutdown()
        del engine
    assert sizes[1] >= 0.95 * sizes[0], sizes
