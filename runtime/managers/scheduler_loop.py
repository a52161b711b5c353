"""SchedulerLoop: drives a Scheduler, round after round, on one asyncio loop.

Each round: get_next_batch_to_run() -> launch the forward on the worker executor
-> process_batch_result(). With overlap on, round N+1's batch is built and
launched before round N's result is processed, so the worker never waits on the
scheduler; inputs that depend on round N are future ids (see future_map.py).
A round that raises ends every request with the error; the loop goes on.
"""

from __future__ import annotations

import asyncio
import collections
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.scheduler import Scheduler
from runtime.model_executor.worker import BatchResult

log = structlog.get_logger("sluice.scheduler")

Pending = collections.deque[tuple[ScheduleBatch, "Future[BatchResult]"]]


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # The worker thread: forwards run there, one at a time, in launch order.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-worker")
        self._stopped = False
        self._idle = asyncio.Event()

    def bind_loop(self) -> None:
        """Called on the loop the scheduler will run on."""
        self.scheduler.bind_loop()
        self._idle = asyncio.Event()

    async def run(self) -> None:
        while not self._stopped:
            pending: Pending = collections.deque()
            try:
                await self._run_rounds(pending)
            except Exception as exc:  # never leave callers hanging on a dead scheduler
                log.exception("scheduler round failed; aborting every request", error=str(exc))
                for _, fut in pending:
                    if not fut.cancel():
                        fut.exception()
                self.scheduler.fail_all(exc)

    async def _run_rounds(self, pending: Pending) -> None:
        s = self.scheduler
        while not self._stopped:
            s.begin_round()
            batch = s.get_next_batch_to_run()
            if batch is not None:
                mwb = batch.get_model_worker_batch(s.futures)
                pending.append((batch.copy_for_result(), s.worker.launch(self.executor, mwb)))
            # With overlap, the previous batch is processed while this one runs.
            depth = 1 if s.enable_overlap and batch is not None else 0
            while len(pending) > depth:
                done_batch, fut = pending.popleft()
                result = await asyncio.wrap_future(fut)
                s.process_batch_result(done_batch, result)
            s.last_batch = batch
            s.inflight = len(pending)
            if batch is None and not pending and not self._stopped:
                if not s.has_work():
                    self._idle.set()
                    await s.sleep_until_woken()
                    self._idle.clear()
            else:
                await asyncio.sleep(0)  # let HTTP handlers run between rounds
        for _, fut in pending:
            fut.result()

    def stop(self) -> None:
        self._stopped = True
        self.scheduler.wake()

    async def wait_idle(self) -> None:
        """Until no request is alive and no forward is in flight."""
        while not (self._idle.is_set() and self.scheduler.is_idle()):
            await self._idle.wait()
            await asyncio.sleep(0)
