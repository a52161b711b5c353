"""Shared fixtures: the default model, an HF transformers greedy oracle, engines
(real ones, and stub-worker ones for the fast tier), and the `slow` mark.

`make test-fast` runs `-m "not slow and not gpu"`: everything that needs no model
weights, no HF reference and no server subprocess, in well under a minute."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.model_executor.model_loader import prepare_model_dir

LONG_TEXT = (
    "The river rose slowly through the night, and by morning the low fields were under water. "
    "Farmers moved their animals to the hills, children watched from the bridge, and the old "
    "sluice gates, closed for the first time in twenty years, held back the flood while the town slept. "
) * 3

PROMPT_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Hi",
    "1, 2, 3, 4,",
    LONG_TEXT + "What held back the flood?",
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_model_dir(None, "auto")


@pytest.fixture(scope="session")
def cpu_ops() -> Any:
    """The compiled CPU kernels (kernels/cpu), built once per machine; skips where they cannot be."""
    from kernels.cpu import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        pytest.skip("the CPU kernels cannot be built here (no compiler or ninja)")
    return ops


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer: Any) -> list[list[int]]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}], tokenize=False, add_generation_prompt=True
    )
    texts = PROMPT_TEXTS + [chat]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


class HFOracle:
    """Greedy decoding with HF transformers in float32, one sequence at a time."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # prompt -> (its greedy run so far, the KV cache and last logits to go on from): a
        # longer ask continues the run with the same forwards, step by step, that a fresh
        # decode would take (EOS does not stop the oracle), and a shorter one is its prefix.
        self._runs: dict[tuple[int, ...], tuple[list[int], Any, torch.Tensor]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = tuple(prompt)
        if key not in self._runs:
            out = self.model(torch.tensor([prompt]), use_cache=True)
            self._runs[key] = ([], out.past_key_values, out.logits[0, -1])
        run, past, logits = self._runs[key]
        while len(run) < max_new_tokens:
            run.append(int(logits.argmax()))
            out = self.model(torch.tensor([[run[-1]]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        self._runs[key] = (run, past, logits)
        return run[:max_new_tokens]

    @torch.inference_mode()
    def logprobs_after(self, ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)

    @torch.inference_mode()
    def logprobs_along(self, prompt: list[int], answer: list[int]) -> torch.Tensor:
        """Row j: `logprobs_after(prompt + answer[:j])`, for every j, from one forward."""
        logits = self.model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : len(prompt) + len(answer) - 1]
        return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="session")
def hf_oracle(model_dir: Path) -> HFOracle:
    return HFOracle(model_dir)


# A greedy token may legitimately differ from the oracle only where the top two
# logprobs are within this (float32 reductions in another order).
NEAR_TIE_LOGPROB = 1e-3


def first_difference(ours: list[int], ref: list[int]) -> int:
    """The index of the first token that differs, or the shorter length where none does."""
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))


def assert_greedy_equal(oracle: HFOracle, prompt: list[int], ours: list[int], max_new_tokens: int) -> None:
    ref = oracle.greedy(prompt, max_new_tokens)
    if ours == ref[: len(ours)] and len(ours) == len(ref):
        return
    j = first_difference(ours, ref)
    assert j < min(len(ours), len(ref)), f"length differs: ours={len(ours)} ref={len(ref)}"
    lp = oracle.logprobs_after(prompt + ours[:j])
    gap = abs(float(lp[ours[j]] - lp[ref[j]]))
    assert gap < NEAR_TIE_LOGPROB, f"token {j} differs: ours {ours[j]} vs HF {ref[j]} (logprob gap {gap:.2e})"


def assert_all_memory_free(engine: Any) -> None:
    """The invariant: once every request ended and the cache is flushed, every KV
    slot and every request-pool row is free."""
    assert engine.wait_idle(timeout=30), "requests still alive 30 s after they should have ended"
    assert engine.flush_cache(), "flush refused: requests still alive"
    info = engine.get_server_info()
    assert info["available_kv_tokens"] == info["max_total_num_tokens"], info
    assert info["req_pool_free_rows"] == info["req_pool_size"], info


# float32, unquantized: the engines these tests build are compared with HF float32
# (quantization=auto would load the embedded GGUF's own Q4_1 blocks).
ENGINE_DEFAULTS: dict[str, Any] = dict(dtype="float32", quantization="none", max_total_tokens=8192, max_running_requests=32)


def _engine_factory() -> Iterator[Callable[..., Any]]:
    from runtime import Engine

    made: list[Any] = []

    def make(**overrides: Any) -> Any:
        engine = Engine(**{**ENGINE_DEFAULTS, **overrides})
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()
    made.clear()
    gc.collect()  # each engine holds a model and a KV pool: free them before the next test


@pytest.fixture
def make_engine() -> Iterator[Callable[..., Any]]:
    """Engines that live for one test."""
    yield from _engine_factory()


@pytest.fixture(scope="module")
def make_module_engine() -> Iterator[Callable[..., Any]]:
    """Engines shared by one test module."""
    yield from _engine_factory()


@pytest.fixture
def make_stub() -> Iterator[Callable[..., Any]]:
    """Engines around a StubWorker (tests/stub_engine.py) for one test. Each must end
    with every KV slot and request row free after a flush: checked here, after the
    test body, for every scenario; then they are shut down."""
    from tests.stub_engine import stub_engine

    made: list[Any] = []

    def make(**overrides: Any) -> Any:
        made.append(stub_engine(**overrides))
        return made[-1]

    yield make
    try:
        for engine in made:
            assert_all_memory_free(engine)
    finally:
        for engine in made:
            engine.shutdown()


# ---- the slow mark ---------------------------------------------------------------------

# A test using any of these loads real weights, builds an HF reference, spawns
# tensor-parallel ranks, or starts a `sluice serve` subprocess (the server fixtures
# of tests/test_server_*.py, test_tp_server.py and test_bench.py). A new fixture
# like them belongs here, or `make test-fast` runs it.
SLOW_FIXTURES = frozenset(
    {
        "hf_oracle", "make_engine", "make_module_engine", "smollm2",  # conftest.py, test_models.py
        "server", "servers", "limited", "offline_engine", "tiny_server", "cluster",  # server suites, test_bench.py
        "tp_engine", "tp_logits", "pd_tp",  # test_tp.py, test_tp_layers.py, test_pd_tp.py
        "traced_server",  # test_server_trace.py, test_dashboard_browser.py
        "qwen3_embedding_dir", "embedding_server",  # test_embeddings.py (a saved HF model, a server)
        "plp_engine",  # test_prompt_logprobs.py
    }
)
# Slow without any of those fixtures: node ids (parameters aside), or a file for all its tests.
SLOW_TESTS = frozenset(
    {
        "tests/test_server_shutdown.py",  # starts its own servers
        "tests/test_bench_tp.py::test_all_reduce_bench_reports_latencies_and_the_collective_share",  # spawns TP ranks
        "tests/test_models.py::test_gguf_q_k_rows_are_unpermuted_to_hf_layout",  # reads the real GGUF
        "tests/test_gguf_smollm2.py",  # --quantization gguf on the real GGUF
        "tests/test_random_gguf.py",  # copies the real GGUF's tokenizer (its header parse: ~6 s)
        "tests/test_tp.py::test_tp3_gguf_blocks_on_the_embedded_model_equal_tp1s_up_to_near_ties",  # real GGUF, 3 ranks
        "tests/test_model_config.py::test_tokenizer_loads_as_autotokenizer_loads_it",  # the real tokenizer
        "tests/test_model_config.py::test_start_up_reads_config_and_tokenizer_without_transformers_config_classes",
        "tests/test_cpu_kernel_cache.py::test_the_kernels_load_with_sluices_own_ninja_whatever_is_first_on_path",
        "tests/test_cpu_default_mode.py",  # quantization=auto on the real GGUF
        "tests/test_pd_tp.py",  # prefill and decode servers at --tp-size 2
        "tests/test_shm_comm.py",  # spawns TP ranks, 2 or 3 per test (test_tp_rendezvous.py keeps the fast check)
        "tests/test_tp.py::test_tp2_fused_decode_stack_runs_the_all_reduces_itself_with_the_module_paths_bits",  # 2 engines at tp 2
    }
)


def is_slow(item: pytest.Item) -> bool:
    path = item.nodeid.split("::", 1)[0]
    name = item.nodeid.split("[", 1)[0]
    return bool(SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ()))) or path in SLOW_TESTS or name in SLOW_TESTS


# The longest files, in seconds run serially on a 2-core Zen 1 (2026-11-28): collected
# first, so that `make test`'s two pytest-xdist workers (one file at a time each,
# --dist loadfile --no-loadscope-reorder: xdist's own order is by test count) start on
# them and end on the short ones, not one of them on test_tp_server alone. Only the
# order changes: a stale list costs minutes, not tests.
LONGEST_FIRST = (
    "test_pd_router.py",  # 146
    "test_engine_correctness.py",  # 121
    "test_deterministic.py",  # 88
    "test_tp_server.py",  # 61
    "test_structured_output.py",  # 57
    "test_tp.py",  # 52
    "test_shm_comm.py",  # ~50 (2026-11-28, 16:00 UTC)
    "test_prefix_sharing.py",  # 51
    "test_prompt_logprobs.py",  # 47
    "test_pd_tp.py",  # 46
    "test_router_dp.py",  # 37
    "test_cpu_default_mode.py",  # 31
    "test_engine_behaviour.py",  # 29
    "test_deterministic_kernels.py",  # 27
    "test_gguf_smollm2.py",  # 26
    "test_server_fuzz.py",  # 20
    "test_server_shutdown.py",  # 20
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)

    def rank(item: pytest.Item) -> int:
        name = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's own order stays
