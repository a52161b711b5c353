"""Engine: the offline and async API over the scheduler.

The scheduler coroutine runs on one event loop: the server's (after `await
engine.start()`), or a private loop in a daemon thread started by the first sync
call. Callers on any loop get their outputs through a queue on their own loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from config.settings import EngineSettings
from runtime import disaggregation, engine_setup
from runtime.engine_requests import RequestRoom
from runtime.engine_setup import EngineStack
from runtime.managers import trace_view
from runtime.managers.io_struct import TraceJSON, TraceSummaryJSON
from runtime.constrained import GrammarBackend
from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.scheduler import Scheduler
from runtime.managers.scheduler_loop import SchedulerLoop
from runtime.managers.embedding_manager import output_processor


class Engine:
    def __init__(self, settings: EngineSettings | None = None, *, stack: EngineStack | None = None, **overrides: Any) -> None:
        """Load the model for `settings` (with `overrides` applied), or run on a prebuilt
        `stack` (tests and benchmarks pass one around a stub worker)."""
        if stack is None:
            stack = engine_setup.build(dataclasses.replace(settings or EngineSettings(), **overrides))
        self.settings = stack.settings
        self.model_config = stack.model_config
        self.tokenizer = stack.tokenizer
        self.pools = stack.pools
        self.worker = stack.worker
        self.model_dir = stack.model_dir
        self.tp = stack.tp
        # Set once when the engine can no longer serve (a tensor-parallel rank died or
        # hung); listeners (the server) are called from whichever thread noticed.
        self.fatal_error: str | None = None
        self._fatal_listeners: list[Callable[[str], None]] = []
        if self.tp is not None:
            self.tp.group.on_failure = self._on_fatal
        self.output = output_processor(self.settings, self.tokenizer)  # an embedding server's hands out vectors
        self.scheduler = Scheduler(self.settings, self.pools, self.worker, self.output)
        self.scheduler_loop = SchedulerLoop(self.scheduler)
        self.trace_exporter = trace_view.export_to(self.scheduler, self.settings.otlp_traces_endpoint)
        if self.settings.grammar_backend == "xgrammar":
            backend = GrammarBackend(self.tokenizer, self.model_config.vocab_size)
            self.scheduler.grammars = GrammarManager(backend, self.scheduler.finish, self.scheduler.wake)
        self.requests = room = RequestRoom(
            self.settings, self.model_config, self.tokenizer, self.pools, self.worker, self.scheduler, self.output,
            self._ensure_started, self._call_on_loop,
        )  # fmt: skip
        # The request API is the room's (runtime/engine_requests.py), called on the engine.
        self.generate, self.async_generate, self.async_generate_stream = room.generate, room.async_generate, room.async_generate_stream
        self.open_stream = room.open_stream
        self.encode, self.async_encode = room.encode, room.async_encode
        self.abort, self.abort_all, self.self_check_bootstrap = room.abort, room.abort_all, room.self_check_bootstrap
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self.disagg: disaggregation.PrefillDisaggregation | disaggregation.DecodeDisaggregation | None = None

    # ---- lifecycle ---------------------------------------------------------------
    async def start(self) -> None:
        """Run the scheduler on the current event loop."""
        if self._loop is not None:
            return
        self.scheduler_loop.bind_loop()
        if self.settings.disaggregation_mode != "null":
            self.disagg = disaggregation.create(self.scheduler, self.worker, self.model_config, self.settings)
            await self.disagg.start()  # a prefill server's bootstrap port must be free
            self.scheduler.disagg = self.disagg
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self.scheduler_loop.run(), name="sluice-scheduler")

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            ready = threading.Event()
            loop = asyncio.new_event_loop()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.run_until_complete(self.start())
                ready.set()
                loop.run_forever()

            self._thread = threading.Thread(target=run, name="sluice-engine-loop", daemon=True)
            self._thread.start()
            ready.wait()
        assert self._loop is not None
        return self._loop

    def _call_on_loop(self, fn: Any, *args: Any) -> None:
        loop = self._ensure_started()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def add_fatal_listener(self, listener: Callable[[str], None]) -> None:
        self._fatal_listeners.append(listener)
        if self.fatal_error is not None:
            listener(self.fatal_error)

    def _on_fatal(self, reason: str) -> None:
        if self.fatal_error is None:
            self.fatal_error = reason
            for listener in list(self._fatal_listeners):
                listener(reason)

    def shutdown(self) -> None:
        if self._loop is None:
            self._close_workers()
            return
        if self.disagg is not None:
            self._call_on_loop(self.disagg.close)
        self._call_on_loop(self.scheduler_loop.stop)
        if self._thread is not None:
            asyncio.run_coroutine_threadsafe(self._await_task(), self._loop).result(timeout=60)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
        self.scheduler_loop.executor.shutdown(wait=False)
        self.requests.close()
        self._close_workers()
        self._loop = None

    def _close_workers(self) -> None:
        if self.trace_exporter is not None:
            self.trace_exporter.shutdown()  # exports what is queued
        if self.scheduler.grammars is not None:
            self.scheduler.grammars.backend.close()
        self.worker.close()
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    async def _await_task(self) -> None:
        if self._task is not None:
            await self._task

    # ---- cache and introspection ------------------------------------------------------------
    async def async_flush_cache(self) -> bool:
        loop = self._ensure_started()
        if asyncio.get_running_loop() is loop:
            return await self._async_flush()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._async_flush(), loop))

    async def _async_flush(self) -> bool:
        # A request that just returned may still have its overlap step in flight:
        # let the scheduler drain (bounded) before judging it busy.
        if self.scheduler.is_idle():
            try:
                await asyncio.wait_for(self.scheduler_loop.wait_idle(), timeout=5.0)
            except TimeoutError:
                pass
        return self.scheduler.flush_cache()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until no request is alive and no forward is in flight."""
        loop = self._ensure_started()

        async def wait() -> None:
            await asyncio.wait_for(self.scheduler_loop.wait_idle(), timeout)

        try:
            asyncio.run_coroutine_threadsafe(wait(), loop).result()
            return True
        except TimeoutError:
            return False

    def flush_cache(self) -> bool:
        loop = self._ensure_started()
        return asyncio.run_coroutine_threadsafe(self._async_flush(), loop).result()

    @property
    def num_waiting_reqs(self) -> int:
        return len(self.scheduler.waiting_queue)

    @property
    def num_running_reqs(self) -> int:
        return self.scheduler.num_running_reqs

    def get_server_info(self) -> dict[str, Any]:
        return self.scheduler.server_info()

    def get_trace(self, rid: str) -> TraceJSON | None:
        """The timeline of a running request or one of the last `trace_buffer_size` finished; None if unknown."""
        return trace_view.trace_of(self.scheduler, rid)

    def recent_traces(self, limit: int = 50) -> list[TraceSummaryJSON]:
        """One line per running request, then per finished one, newest first."""
        return trace_view.recent(self.scheduler, limit)
