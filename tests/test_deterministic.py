"""`--enable-deterministic-inference`: a temperature-0 completion is the same tokens
whatever runs beside it (issue #17's experiment, on the real SmolLM2 weights).

Each target prompt is first generated alone on an empty cache. Then the same targets
run in five batch compositions: all together; shuffled among fillers of other
lengths; arriving while fillers decode (their prefill shares forwards with decodes);
after their first halves were cached (the radix cache serves a prefix, the rest is
prefilled as a continuation); and one at a time into a running batch. Every one of
those completions must equal the target's completion alone, token for token.

Without the flag this test fails in both modes (run on the AMX Xeon, 2026-11-24):
bfloat16 changed 6 of its 40 batched completions (oneDNN picks its GEMM kernel by the
batch's row count), the default mode 2 (both after a cached prefix: SDPA over a
cached prefix sums in another order than over the whole prompt).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from bench.deterministic import beside_fillers
from runtime.layers.quantization.gguf import native_bf16_matmul
from runtime.token_roles import TokenPrompt
from tests.conftest import LONG_TEXT, assert_all_memory_free

MAX_NEW = 16
Tokens = list[int]

MODES: dict[str, dict[str, Any]] = {
    # The setting: bfloat16 matmuls (AMX / AVX512-BF16), no quantization.
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    # What `sluice serve` runs on CPU by default: gguf blocks, float32 elsewhere.
    "default": {"dtype": "auto", "quantization": "auto"},
}
# Where oneDNN emulates bfloat16 (AVX2 only: `dtype auto` picks float32 there) the
# bfloat16 run takes 5.5 minutes on a Zen 1 EPYC, a seventh of the suite, for the same
# fixed-row-block code every CPU runs; test_deterministic_kernels checks oneDNN's
# bfloat16 rows for batch invariance on every CPU.
MODE_PARAMS = [
    pytest.param(
        "bfloat16",
        marks=pytest.mark.skipif(
            not native_bf16_matmul(torch.device("cpu")), reason="bfloat16 is emulated on this CPU (no AMX / AVX512-BF16)"
        ),
    ),
    "default",
]


def greedy(n: int = MAX_NEW) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def empty_cache(engine: Any) -> None:
    assert engine.wait_idle(timeout=60) and engine.flush_cache()


def ids(outs: Any) -> list[Tokens]:
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def targets_and_fillers(tokenizer: Any, prompts: list[Tokens]) -> tuple[list[Tokens], list[Tokens]]:
    shared = tokenizer.encode(LONG_TEXT, add_special_tokens=False)
    targets = prompts + [shared + tokenizer.encode(q, add_special_tokens=False) for q in ("Who slept?", "Name the gates.")]
    rng = random.Random(3)
    fillers = [[rng.randrange(100, 40000) for _ in range(rng.randint(5, 200))] for _ in range(8)]
    return targets, fillers


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_temperature_0_output_is_independent_of_batch_composition(
    mode: str, make_module_engine: Any, targets_and_fillers: tuple[list[Tokens], list[Tokens]]
) -> None:
    targets, fillers = targets_and_fillers
    engine = make_module_engine(enable_deterministic_inference=True, **MODES[mode])
    alone = []
    for t in targets:
        empty_cache(engine)
        alone.append(engine.generate(t, greedy())["output_ids"])

    batched: dict[str, list[Tokens]] = {}
    empty_cache(engine)
    batched["together"] = ids(engine.generate(targets, greedy()))
    empty_cache(engine)
    order = list(range(len(targets) + len(fillers)))
    random.Random(5).shuffle(order)
    mixed = ids(engine.generate([(targets + fillers)[i] for i in order], greedy()))
    batched["among fillers"] = [mixed[order.index(i)] for i in range(len(targets))]
    empty_cache(engine)
    batched["beside decodes"] = beside_fillers(engine, fillers, lambda: ids(engine.generate(targets, greedy())), MAX_NEW)
    empty_cache(engine)
    halved = [i for i, t in enumerate(targets) if len(t) >= 4]
    engine.generate([targets[i][: len(targets[i]) // 2] for i in halved], greedy(1))
    outs_cached = engine.generate(targets, greedy())
    assert all(outs_cached[i]["meta_info"]["cached_tokens"] > 0 for i in halved), "targets should start from a cached half"
    batched["after a cached prefix"] = ids(outs_cached)
    empty_cache(engine)
    batched["one by one into a batch"] = beside_fillers(
        engine, fillers, lambda: [engine.generate(t, greedy())["output_ids"] for t in targets], MAX_NEW
    )

    changed = {name: [i for i, (a, b) in enumerate(zip(alone, outs)) if a != b] for name, outs in batched.items()}
    assert not any(changed.values()), f"completions that changed with their batch (target indices): {changed}"
    assert_all_memory_free(engine)


def test_deterministic_inference_is_refused_where_it_is_not_implemented(make_engine: Any) -> None:
    from config.settings import SettingsError

    with pytest.raises(SettingsError, match="deterministic"):
        make_engine(enable_deterministic_inference=True, disable_cpu_kernels=True)


def test_recomputed_and_reused_outputs_change_no_bit(
    make_engine: Any, cpu_ops: Any, targets_and_fillers: tuple[list[Tokens], list[Tokens]]
) -> None:
    """The ways a generated token's KV is met again: a retracted request re-prefills its
    outputs (an extend, yet on the answers' kernel: PromptRows), and a next turn's prompt
    repeats an earlier prompt and its output - as given text (the tree keys tokens by role,
    so those tokens are prefilled as given text, as on an empty cache) or marked as an
    earlier answer (TokenPrompt.answer_spans: the answer's KV comes from the cache, and on
    an empty cache it is prefilled on the answers' kernel). Each gives the tokens and the
    logprob bits the request gets alone on an empty cache."""
    targets, _ = targets_and_fillers
    max_new = 32
    pool = max(len(t) for t in targets) + max_new + 64  # room for one, far from all at once
    engine = make_engine(
        enable_deterministic_inference=True,
        max_total_tokens=pool,
        chunked_prefill_size=64,
        schedule_conservativeness=0.3,
        **MODES["default"],  # where given and generated tokens take different kernels
    )
    cached: list[int] = []

    def run(prompts: list[Any]) -> list[tuple[Tokens, list[float]]]:
        outs = engine.generate(prompts, greedy(max_new), return_logprob=True)
        cached.extend(o["meta_info"]["cached_tokens"] for o in outs)
        return [(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]

    def each_alone(prompts: list[Any]) -> list[tuple[Tokens, list[float]]]:
        results = []
        for p in prompts:
            empty_cache(engine)
            results += run([p])
        return results

    alone = each_alone(targets)
    empty_cache(engine)
    assert run(targets) == alone
    assert engine.get_server_info()["num_retracted_reqs_total"] > 0

    given = [t + out + t[:3] for t, (out, _) in zip(targets, alone)]
    marked = [TokenPrompt(turn, ((len(t), len(t) + len(out)),)) for t, turn, (out, _) in zip(targets, given, alone)]
    fresh_by_kind = []
    for next_turns, reused in ((given, [len(t) for t in targets]), (marked, [len(t) + max_new - 1 for t in targets])):
        fresh = each_alone(next_turns)
        fresh_by_kind.append(fresh)
        after = []
        cached.clear()
        for t, turn in zip(targets, next_turns):
            empty_cache(engine)
            run([t])  # the first turn, then the next with it cached
            after += run([turn])
        assert after == fresh
        assert cached[1::2] == reused  # the first turn's prompt; and its answer's KV when marked
    # Marking the answer changes its tokens' kernel where given text has its own (the bf16
    # tiles: AMX / AVX512-BF16; the float32 panels: AVX2 without AVX-512), so (on these
    # weights) the bits too; without either both roles run on the Q4 blocks, and marking
    # changes only what the cache may share.
    fresh_given, fresh_marked = fresh_by_kind
    if cpu_ops.bf16_linear_isas() or cpu_ops.f32_linear_isa():
        assert fresh_marked != fresh_given
    else:
        assert fresh_marked == fresh_given
    assert_all_memory_free(engine)
