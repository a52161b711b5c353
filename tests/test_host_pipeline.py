"""HostPipeline: when a host step's result reaches the scheduler.

Promised: every launched step's Future completes (a result, its own error, or
cancelled when the executor drops it), in launch order; a step with a successor
already queued is published only after that successor's inputs are built; one with
none queued is published at once.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

import pytest

from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.host_pipeline import HostPipeline
from runtime.model_executor.worker import BatchResult, ModelWorkerBatch


class Mwb:
    def __init__(self, name: str) -> None:
        self.name = name


class Steps:
    """Records each half of each step; `gate` holds a named step's build until released."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.fail_build: set[str] = set()
        self.gates: dict[str, threading.Event] = {}

    def build_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch:
        name = cast(Mwb, mwb).name
        if name in self.gates:
            self.gates[name].wait(5)
        self.events.append(f"build {name}")
        if name in self.fail_build:
            raise RuntimeError(f"bad batch {name}")
        return cast(ForwardBatch, name)

    def run_step(self, fb: ForwardBatch, mwb: ModelWorkerBatch) -> BatchResult:
        self.events.append(f"run {cast(str, fb)}")
        return BatchResult(next_token_ids=[len(self.events)])


def launch(pipe: HostPipeline, executor: ThreadPoolExecutor, name: str, steps: Steps) -> Future[BatchResult]:
    fut = pipe.launch(executor, cast(ModelWorkerBatch, Mwb(name)))
    fut.add_done_callback(lambda _: steps.events.append(f"published {name}"))
    return fut


def test_a_step_with_none_queued_behind_it_is_published_at_once() -> None:
    steps = Steps()
    pipe = HostPipeline(steps)
    with ThreadPoolExecutor(max_workers=1) as ex:
        assert launch(pipe, ex, "a", steps).result(timeout=5).next_token_ids == [2]
        assert launch(pipe, ex, "b", steps).result(timeout=5).next_token_ids == [5]
    assert steps.events == ["build a", "run a", "published a", "build b", "run b", "published b"]


def test_a_queued_successor_builds_its_inputs_before_the_result_is_published() -> None:
    steps = Steps()
    pipe = HostPipeline(steps)
    steps.gates["a"] = threading.Event()  # hold the worker until both steps are queued
    with ThreadPoolExecutor(max_workers=1) as ex:
        fa = launch(pipe, ex, "a", steps)
        fb = launch(pipe, ex, "b", steps)
        fc = launch(pipe, ex, "c", steps)
        steps.gates["a"].set()
        results = [f.result(timeout=5).next_token_ids for f in (fa, fb, fc)]
    assert steps.events == [
        "build a", "run a",
        "build b", "published a", "run b",
        "build c", "published b", "run c", "published c",
    ]  # fmt: skip
    assert results == [[2], [5], [8]]


def test_a_failing_build_still_publishes_the_held_result_and_fails_only_its_own_step() -> None:
    steps = Steps()
    steps.fail_build.add("b")
    steps.gates["a"] = threading.Event()
    pipe = HostPipeline(steps)
    with ThreadPoolExecutor(max_workers=1) as ex:
        fa, fb, fc = (launch(pipe, ex, n, steps) for n in "abc")
        steps.gates["a"].set()
        assert fa.result(timeout=5).next_token_ids == [2]
        with pytest.raises(RuntimeError, match="bad batch b"):
            fb.result(timeout=5)
        assert fc.result(timeout=5).next_token_ids
    assert steps.events.index("published a") > steps.events.index("build b")


def test_steps_the_executor_drops_are_cancelled_and_the_held_result_still_arrives() -> None:
    steps = Steps()
    steps.gates["a"] = threading.Event()
    pipe = HostPipeline(steps)
    ex = ThreadPoolExecutor(max_workers=1)
    fa, fb = launch(pipe, ex, "a", steps), launch(pipe, ex, "b", steps)
    ex.shutdown(wait=False, cancel_futures=True)  # "b" never starts
    steps.gates["a"].set()
    assert isinstance(fa.result(timeout=5), BatchResult)
    assert fb.cancelled()
    assert [e for e in steps.events if not e.startswith("published")] == ["build a", "run a"]


def test_a_launch_the_executor_refuses_does_not_leave_the_running_step_held() -> None:
    steps = Steps()
    steps.gates["a"] = threading.Event()
    pipe = HostPipeline(steps)
    ex = ThreadPoolExecutor(max_workers=1)
    fa = launch(pipe, ex, "a", steps)
    ex.shutdown(wait=False)
    with pytest.raises(RuntimeError):
        launch(pipe, ex, "b", steps)
    steps.gates["a"].set()
    assert isinstance(fa.result(timeout=5), BatchResult)  # published, not held for "b"
