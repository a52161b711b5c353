"""The fast tier: a real Engine (Scheduler, pools, tokenizer) around a StubWorker.

StubWorker (runtime/model_executor/stub_worker.py) has no model: each token it
returns is a hash of the sequence it reads back through req_to_token and the KV
slots. A scheduler that feeds a wrong slot, position, prefix or future id gets a
different token, so `oracle` (greedy_reference) is what every output must equal,
whatever the scheduler did on the way: chunking, pages, mixing, overlap,
retraction, prefix sharing.

Hooks that reach into the scheduler run on its own loop at an exact point of a
round (`on_launch`: right after a forward was launched, before its result is
processed), so a test aborts "mid-chunked-prefill" or "right after launch"
without sleeping and without racing the scheduler.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, cast

from transformers import AutoTokenizer

from config.settings import EngineSettings
from runtime.engine import Engine
from runtime.engine_setup import build_stub
from runtime.model_executor.model_loader import prepare_model_dir
from runtime.managers.prefill_manager import PrefillBatch
from runtime.managers.req import Req
from runtime.model_executor.forward_batch import ForwardMode
from runtime.model_executor.stub_worker import greedy_reference
from runtime.model_executor.worker import BatchResult, ModelWorkerBatch

STUB_DEFAULTS: dict[str, Any] = dict(max_total_tokens=4096, max_running_requests=16)
VOCAB_SIZE = 49152  # the default model's
FIRST_PLAIN_TOKEN = 17  # ids below are the default tokenizer's special tokens

# The scheduler configurations of tests/test_engine_correctness.py (less the attention
# kernel, which a stub has none of), plus chunk boundaries that fall inside a page.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "no-radix": {"disable_radix_cache": True},
    "chunk16": {"chunked_prefill_size": 16},
    "page4-chunk10": {"page_size": 4, "chunked_prefill_size": 10},
    "page16": {"page_size": 16},
    "page16-chunk32-no-radix": {"page_size": 16, "chunked_prefill_size": 32, "disable_radix_cache": True},
    "page16-chunk24": {"page_size": 16, "chunked_prefill_size": 24},
    "mixed-chunk16": {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
    "mixed-page4-chunk10": {"enable_mixed_chunk": True, "page_size": 4, "chunked_prefill_size": 10},
    "chunk16-page16": {"chunked_prefill_size": 16, "page_size": 16},
    "lpm-page4": {"schedule_policy": "lpm", "page_size": 4},
}
OVERLAP = {"overlap": False, "no-overlap": True}  # id -> disable_overlap_schedule


@functools.cache
def _default_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(prepare_model_dir(None, "auto"))


def stub_engine(**overrides: Any) -> Engine:
    # Reading the tokenizer is most of build_stub's time (~0.2 s of ~0.25 s) and the
    # fast tier builds a hundred engines over the one default tokenizer, which an
    # engine only reads: load it once per session.
    stack = build_stub(EngineSettings(**{**STUB_DEFAULTS, **overrides}), tokenizer=_default_tokenizer())
    return Engine(stack=stack)


Output = dict[str, Any]  # one request's output: docs/engine_api.md


def generate_one(engine: Engine, prompt: list[int], params: dict[str, Any]) -> Output:
    return cast(Output, engine.generate(prompt, params))


def generate_all(
    engine: Engine, prompts: list[list[int]], params: dict[str, Any] | Sequence[dict[str, Any]], **kwargs: Any
) -> list[Output]:
    """Engine.generate of a batch: every prompt is queued before the scheduler's next round."""
    each = params if isinstance(params, dict) else list[Any](params)
    return cast(list[Output], engine.generate(prompts, each, **kwargs))


def submit(engine: Engine, rid: str, prompt: list[int], params: dict[str, Any]) -> Awaitable[Output]:
    """One request with a known rid, from the caller's loop."""
    return engine.async_generate(prompt, params, rid=rid)


def greedy(max_new_tokens: int, **params: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **params}


def oracle(engine: Engine, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
    return greedy_reference(list(prompt), max_new_tokens, engine.model_config.vocab_size, frozenset(stop_ids))


def make_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_PLAIN_TOKEN, VOCAB_SIZE) for _ in range(length)]


def make_prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Prompts of these lengths sharing no prefix (each starts with its own token)."""
    return [[FIRST_PLAIN_TOKEN + i] + make_prompt(n - 1, seed * 1000 + i) for i, n in enumerate(lengths)]


def output_ids(outs: Sequence[Output]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def finish_types(outs: Sequence[Output]) -> list[str]:
    return [o["meta_info"]["finish_reason"]["type"] for o in outs]


# ---- hooks on the scheduler's loop -------------------------------------------------------

LaunchHook = Callable[[ModelWorkerBatch], bool]


def on_launch(engine: Engine, hook: LaunchHook) -> None:
    """Call `hook(mwb)` on the scheduler's loop right after each forward is launched,
    until it returns True. What it does (abort, read state) happens exactly between
    that launch and the processing of any later result."""
    worker = engine.worker
    launch = worker.launch
    done = False

    def launch_then_hook(executor: Executor, mwb: ModelWorkerBatch) -> Future[BatchResult]:
        nonlocal done
        future = launch(executor, mwb)
        if not done:
            done = hook(mwb)
        return future

    worker.launch = launch_then_hook  # type: ignore[method-assign]


def running_in(engine: Engine, rid: str, mwb: ModelWorkerBatch) -> Req | None:
    """The request `rid` if the forward `mwb` computes it."""
    req = engine.scheduler.reqs_by_rid.get(rid)
    return req if req is not None and req.req_pool_idx in mwb.req_pool_indices else None


def abort_when(engine: Engine, rid: str | None, cond: Callable[[ModelWorkerBatch], bool]) -> None:
    """Abort `rid` (every request if None) right after the first launch for which
    `cond(mwb)` holds, as if the abort arrived while that forward runs."""

    def hook(mwb: ModelWorkerBatch) -> bool:
        if not cond(mwb):
            return False
        engine.scheduler.abort(rid)
        return True

    on_launch(engine, hook)


@dataclass(frozen=True, slots=True)
class Pause:
    reached: threading.Event  # set once the scheduler is held
    release: threading.Event  # the test sets it to let the scheduler go on


def pause_when(engine: Engine, cond: Callable[[ModelWorkerBatch], bool]) -> Pause:
    """Hold the scheduler's loop right after the first launch for which `cond(mwb)`
    holds, until the test sets `release`: whatever the test does meanwhile (close a
    stream, cancel a caller) reaches the scheduler with that forward in flight."""
    pause = Pause(threading.Event(), threading.Event())

    def hook(mwb: ModelWorkerBatch) -> bool:
        if not cond(mwb):
            return False
        pause.reached.set()
        assert pause.release.wait(timeout=30), "the test never released the scheduler"
        return True

    on_launch(engine, hook)
    return pause


def record_forwards(engine: Engine) -> list[ModelWorkerBatch]:
    """Every forward the scheduler launches, in launch order."""
    log: list[ModelWorkerBatch] = []

    def record(mwb: ModelWorkerBatch) -> bool:
        log.append(mwb)
        return False  # never done

    on_launch(engine, record)
    return log


def track(engine: Engine, rid: str) -> list[tuple[ForwardMode, int, int]]:
    """(mode, prefix length, extend length) of every forward launched for `rid`."""
    seen: list[tuple[ForwardMode, int, int]] = []

    def record(mwb: ModelWorkerBatch) -> bool:
        req = running_in(engine, rid, mwb)
        if req is not None:
            i = mwb.req_pool_indices.index(req.row)
            seen.append((mwb.forward_mode, mwb.extend_prefix_lens[i], mwb.extend_seq_lens[i]))
        return False  # never done

    on_launch(engine, record)
    return seen


def record_admissions(engine: Engine) -> list[Req]:
    """Requests in the order the scheduler first puts them in a prefill batch."""
    admitted: list[Req] = []
    prefill = engine.scheduler.prefill
    build = prefill.get_new_batch_prefill

    def build_and_record(*args: Any, **kwargs: Any) -> PrefillBatch | None:
        new = build(*args, **kwargs)
        if new is not None:
            admitted.extend(r for r in new.batch.reqs if all(r is not a for a in admitted))
        return new

    prefill.get_new_batch_prefill = build_and_record  # type: ignore[method-assign]
    return admitted


def prompt_order(admitted: Sequence[Req], prompts: Sequence[Sequence[int]]) -> list[int]:
    """Indices into `prompts` of the admitted requests, in admission order."""
    return [[list(p) for p in prompts].index(r.origin_input_ids) for r in admitted]
