"""Tensor parallelism, in-process: rank 0 in this process, rank 1 spawned, gloo on loopback.

Greedy outputs at tp_size 2 equal HF transformers on the same weights (float32), in
the scheduler settings that move KV around (radix cache off, chunked prefill, pages,
overlap off), single and batched; after every scenario the memory invariant holds
on rank 0, whose scheduler owns every slot and row (the other ranks hold no
allocator: they write exactly the slots rank 0 broadcasts).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import HFOracle, assert_all_memory_free, assert_greedy_equal, first_difference
from tests.tiny_checkpoints import make_llama_checkpoint

MAX_NEW = 12
# tp3 vs tp1 on the GGUF blocks: the all-reduce's order, each rank's measured kernel crossover
# and the float16 KV rounding what those move; measured max 0.0031 over the test prompts
# (AVX2: float32 panels for prefill).
TP_GGUF_LOGPROB = 0.01
# Where bfloat16 is native the prefill's linears round their inputs to bfloat16 (bf16_linear
# tiles): a float32 difference in the last place of a row-parallel sum flips some of those
# roundings (a relative 2^-8 each) in the next layers, so the same difference ends larger;
# measured max 0.0143 over the test prompts on a Zen 4 (AVX512-BF16, 2026-11-28).
TP_GGUF_LOGPROB_BF16 = 0.04
SCENARIOS: list[dict[str, Any]] = [
    {},
    {"disable_radix_cache": True},
    {"chunked_prefill_size": 16, "page_size": 4},
    {"disable_overlap_schedule": True, "enable_mixed_chunk": True, "chunked_prefill_size": 32},
]


@pytest.fixture(scope="module", params=[2, 1], ids=["kv_heads_eq_tp", "kv_heads_lt_tp"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp(f"llama-kv{request.param}"), tokenizer, num_kv_heads=request.param)


@pytest.fixture(scope="module")
def oracle(checkpoint: Path) -> HFOracle:
    return HFOracle(checkpoint)


@pytest.fixture
def tp_engine(checkpoint: Path) -> Iterator[Any]:
    from runtime import Engine

    engines: list[Any] = []

    def make(**overrides: Any) -> Any:
        base = dict(model_path=str(checkpoint), dtype="float32", max_total_tokens=4096, max_running_requests=16, tp_size=2)
        engines.append(Engine(**{**base, **overrides}))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: ",".join(s) or "default")
def test_tp2_greedy_equals_hf_batched_and_single(tp_engine: Any, oracle: HFOracle, prompts: list[list[int]], scenario: dict[str, Any]) -> None:
    engine = tp_engine(**scenario)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert_greedy_equal(oracle, prompt, out["output_ids"], MAX_NEW)
    single = engine.generate(prompts[0], params)
    assert single["output_ids"] == outs[0]["output_ids"]
    assert_all_memory_free(engine)


def test_tp2_kv_pool_holds_only_this_ranks_heads(tp_engine: Any) -> None:
    """Two KV heads split one per rank (per-rank KV memory halves); one KV head is replicated."""
    engine = tp_engine()
    total_kv = engine.model_config.num_kv_heads
    assert engine.worker.kv_pool.num_kv_heads == (1 if total_kv == 1 else total_kv // 2)


def test_tp3_on_the_embedded_model_equals_hf(hf_oracle: HFOracle, prompts: list[list[int]]) -> None:
    """SmolLM2 (9 heads, 3 KV heads) split three ways, GGUF converted once and read sharded
    (its weights in float32: the HF oracle's mode; the default, the file's own blocks, is
    the next test's)."""
    from runtime import Engine

    engine = Engine(dtype="float32", quantization="none", max_total_tokens=4096, max_running_requests=8, tp_size=3)
    try:
        outs = engine.generate(prompts, {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
        for prompt, out in zip(prompts, outs):
            assert_greedy_equal(hf_oracle, prompt, out["output_ids"], MAX_NEW)
        assert_all_memory_free(engine)
    finally:
        engine.shutdown()


def test_tp3_gguf_blocks_on_the_embedded_model_equal_tp1s_up_to_near_ties(prompts: list[list[int]]) -> None:
    """`--quantization gguf` split three ways: each rank packs only its rows of the file's
    Q4_1 blocks (o_proj and down_proj: its 32-column-aligned blocks of every row), and an
    activation row is rounded to integers per the same 32 columns, so a rank's partial
    products are tp1's; what differs is the order the all-reduce sums them in, and which
    kernel a rank's measured crossover picks for a batch. So tp3's tokens equal tp1's but
    at a near-tie, their logprobs within float32 noise of tp1's. (Not HF's greedy tokens:
    where bfloat16 is native a prefill runs on bfloat16 tiles, which agree with float32 on
    ~99% of tokens, not up to near-ties; tests/test_cpu_default_mode.py holds that bar.)"""
    from runtime import Engine
    from runtime.layers.linear import LinearBase
    from runtime.layers.quantization import linear_form

    # (deterministic inference off on both: `auto` turns it on at tp 1 on some CPUs, never at tp > 1)
    settings: dict[str, Any] = dict(quantization="gguf", enable_deterministic_inference=False, max_total_tokens=4096, max_running_requests=8)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    engine = Engine(**settings)
    try:
        refs = engine.generate(prompts, params, return_logprob=True, top_logprobs_num=2)
    finally:
        engine.shutdown()
    engine = Engine(**settings, tp_size=3)
    try:
        assert {linear_form(m) for m in engine.worker.model.modules() if isinstance(m, LinearBase)} == {"q4q8"}
        bf16_tiles = any(hasattr(m, "dense_tiles") for m in engine.worker.model.modules())
        tolerance = TP_GGUF_LOGPROB_BF16 if bf16_tiles else TP_GGUF_LOGPROB
        outs = engine.generate(prompts, params, return_logprob=True)
        for ref, out in zip(refs, outs):
            ours, theirs = out["output_ids"], ref["output_ids"]
            j = first_difference(ours, theirs)  # same lengths: len(ours) where none differs
            ours_lp = [lp for lp, _ in out["meta_info"]["output_token_logprobs"][: j + 1]]
            theirs_lp = [lp for lp, _ in ref["meta_info"]["output_token_logprobs"][: j + 1]]
            assert max(abs(a - b) for a, b in zip(ours_lp, theirs_lp)) < tolerance, (ours_lp, theirs_lp)
            if j < len(ours):  # a divergence: both tokens were tp1's top two, nearly tied
                (lp0, t0), (lp1, t1) = ref["meta_info"]["output_top_logprobs"][j]
                assert {t0, t1} == {ours[j], theirs[j]} and lp0 - lp1 < tolerance, (j, ours[j], theirs[j], lp0, lp1)
        assert_all_memory_free(engine)
    finally:
        engine.shutdown()


def test_tp2_deterministic_inference_gives_a_prompt_its_bits_whatever_runs_beside_it(tp_engine: Any, prompts: list[list[int]]) -> None:
    """--enable-deterministic-inference across two ranks: every rank's matmuls run in fixed
    row blocks and split rows by role from the broadcast role_switches, and the all-reduce
    sums two partials per element whatever the batch. So each prompt's tokens and logprob
    bits alone on an empty cache equal those amid the others and fillers in chunked
    prefills, and a next turn that marks the answer (its KV from the cache) equals the
    same turn on an empty cache."""
    from runtime.token_roles import TokenPrompt

    engine = tp_engine(enable_deterministic_inference=True, chunked_prefill_size=32)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}

    cached: list[int] = []

    def run(batch: list[Any]) -> list[tuple[list[int], list[float]]]:
        outs = engine.generate(batch, params, return_logprob=True)
        cached.extend(o["meta_info"]["cached_tokens"] for o in outs)
        return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]

    def alone(batch: list[Any]) -> list[tuple[list[int], list[float]]]:
        results = []
        for p in batch:
            assert engine.wait_idle(timeout=60) and engine.flush_cache()
            results += run([p])
        return results

    first = alone(prompts)
    fillers = [[(7 * i + j) % 500 + 3 for j in range(20 + 9 * i)] for i in range(6)]
    assert engine.flush_cache()
    assert run(fillers[:3] + prompts + fillers[3:])[3 : 3 + len(prompts)] == first

    turns = [TokenPrompt(p + out + p[:2], ((len(p), len(p) + len(out)),)) for p, (out, _) in zip(prompts, first)]
    fresh = alone(turns)
    after = []
    cached.clear()
    for p, turn in zip(prompts, turns):
        assert engine.wait_idle(timeout=60) and engine.flush_cache()
        run([p])
        after += run([turn])
    assert after == fresh
    assert cached[1::2] == [len(p) + MAX_NEW - 1 for p in prompts]  # the prompt and the answer's KV
    assert_all_memory_free(engine)


def test_tp2_fused_decode_stack_runs_the_all_reduces_itself_with_the_module_paths_bits(tmp_path: Path) -> None:
    """At tp 2 with the collectives in shared memory, kernels/cpu/decode_stack.cpp takes a
    decode step's layers in one call and all-reduces o_proj's and down_proj's partial sums
    itself; over gloo (--disable-custom-all-reduce) the row-parallel modules do, one layer
    at a time. Two ranks' sums are one addition either way, so tokens and logprobs are the
    same bits. (A GGUF shaped for tp 2, random weights; one request at a time, so each
    decode step is one row: the Q4 blocks on every rank whatever its measured crossover.)"""
    from bench.random_gguf import write_random_gguf
    from kernels.cpu import load_cpu_ops
    from runtime import Engine

    ops = load_cpu_ops()
    if ops is None or not ops.q4_linear_isa():
        pytest.skip("the fused decode stack runs q4q8 linears: the CPU kernels with AVX2 or AVX512-VNNI")
    model = tmp_path / "tp2.gguf"
    write_random_gguf(model, hidden=256, heads=4, kv_heads=2, intermediate=512, layers=2)
    prompts = [[1000 + 7 * i + j for j in range(5 + 3 * i)] for i in range(3)]
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    runs = []
    for gloo in (False, True):
        engine = Engine(
            model_path=str(model), tp_size=2, enable_deterministic_inference=False, disable_custom_all_reduce=gloo,
            max_total_tokens=2048, max_running_requests=4,
        )  # fmt: skip
        try:
            stack = engine.worker.model.model.decode_stack
            assert (stack is None) == gloo, "the stack runs at tp 2 exactly where the collectives are in shared memory"
            outs = [engine.generate(p, params, return_logprob=True) for p in prompts]
            runs.append([(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs])
            assert_all_memory_free(engine)
        finally:
            engine.shutdown()
    assert runs[0] == runs[1]
