"""HostPipeline: the order in which a host (CPU) worker publishes its steps' results.

On the CPU a step's Python (its inputs, the attention plan, sampling) holds the GIL, and
only the kernels in between release it. Completing step N's Future wakes the scheduler,
whose round (processing N, building and launching N+2, the HTTP streams' sends) is
Python too: published at the end of step N, that round contends for the GIL with step
N+1's input building, every torch call of which hands the GIL back and forth, on the
critical path of every token.

So when step N+1 is already queued (the overlap scheduler's steady state), step N's
result is held until step N+1's inputs are built and published just before its kernels:
the scheduler's round then runs beside kernels that do not hold the GIL. A step that
finds nothing queued behind it publishes at once, so no result ever waits on a step
that may not come. Steps still run one at a time, in launch order, on the executor's
one thread; invariant: at most one result is held, and only while a later step is
queued or building its inputs.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future
from typing import Protocol

import torch

from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.worker import BatchResult, ModelWorkerBatch


class HostSteps(Protocol):
    """A host worker's step in two halves (looked up per step, so a benchmark can time them)."""

    def build_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch: ...

    def run_step(self, fb: ForwardBatch, mwb: ModelWorkerBatch) -> BatchResult: ...


class HostPipeline:
    def __init__(self, steps: HostSteps) -> None:
        self._steps = steps
        self._lock = threading.Lock()
        self._queued = 0  # launched steps that have not started
        self._held: tuple[Future[BatchResult], BatchResult] | None = None

    def launch(self, executor: Executor, mwb: ModelWorkerBatch) -> Future[BatchResult]:
        result: Future[BatchResult] = Future()
        with self._lock:
            self._queued += 1
        try:
            work = executor.submit(self._step, mwb, result)
        except BaseException:  # a shut-down executor: nothing is queued behind a running step
            with self._lock:
                self._queued -= 1
            raise

        def dropped(work: Future[None]) -> None:  # the executor shut down before it ran
            if work.cancelled():
                with self._lock:
                    self._queued -= 1
                result.cancel()
                self._publish_held()

        work.add_done_callback(dropped)
        return result

    @torch.inference_mode()
    def _step(self, mwb: ModelWorkerBatch, result: Future[BatchResult]) -> None:
        with self._lock:
            self._queued -= 1
        if not result.set_running_or_notify_cancel():  # the scheduler gave up on it
            self._publish_held()
            return
        try:
            try:
                fb = self._steps.build_forward_batch(mwb)
            finally:
                self._publish_held()
            out = self._steps.run_step(fb, mwb)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting scheduler
            result.set_exception(e)
            return
        with self._lock:
            if self._queued:  # the next step publishes it once its inputs are built
                self._held = (result, out)
                return
        result.set_result(out)

    def _publish_held(self) -> None:
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            held[0].set_result(held[1])
