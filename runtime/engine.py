"""Engine: the offline and async API over the scheduler.

The scheduler coroutine runs on one event loop: the server's (after `await
engine.start()`), or a private loop in a daemon thread started by the first sync
call. Callers on any loop get their outputs through a queue on their own loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from config.settings import EngineSettings
from runtime import disaggregation, engine_setup
from runtime.engine_encode import EncodeAPI, Prompt
from runtime.engine_setup import EngineStack
from runtime.errors import InvalidRequest
from runtime.managers import trace_view
from runtime.managers.io_struct import FAKE_BOOTSTRAP_HOST, BootstrapInfo, GenerateOutput, TraceJSON, TraceSummaryJSON
from runtime.managers.req import Req
from runtime.constrained import GrammarBackend
from runtime.managers.grammar_manager import GrammarManager
from runtime.managers.scheduler import Scheduler
from runtime.managers.scheduler_loop import SchedulerLoop
from runtime.managers.embedding_manager import output_processor
from runtime.managers.tokenizer_manager import LogprobOptions, RequestLimits, SamplingInput, make_req
from runtime.managers.trace import TraceOptions

Delivery = GenerateOutput | InvalidRequest  # what a request's queue carries to its caller


class Engine(EncodeAPI):  # encode/async_encode: runtime/engine_encode.py
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
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sluice-tokenize")
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
        self._tokenize_pool.shutdown(wait=False)
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

    # ---- requests ---------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))  # with the model's BOS, as HF/vLLM/SGLang do
        return list(prompt)

    def _limits(self) -> RequestLimits:
        s, config = self.settings, self.model_config
        return RequestLimits(config.context_len, config.vocab_size, self.pools.max_total_num_tokens - s.page_size,
                             config.eos_token_ids, self.worker.device, s.is_embedding, s.disaggregation_mode,
                             disaggregation.needs_bootstrap(s), self.scheduler.grammars is not None,
                             refuses_priority=s.abort_on_priority_when_disabled and s.schedule_policy != "priority")

    async def _submit(
        self, prompt: Prompt, params: SamplingInput, rid: str | None, stream: bool, logprobs: LogprobOptions,
        bootstrap: BootstrapInfo | None = None, trace: TraceOptions | None = None, priority: int | None = None,
    ) -> tuple[Req, asyncio.Queue[Delivery]]:
        arrival = time.monotonic()
        caller = asyncio.get_running_loop()
        engine_loop = self._ensure_started()
        if isinstance(prompt, str):
            ids = await caller.run_in_executor(self._tokenize_pool, self._tokenize, prompt)
        elif isinstance(prompt, list):
            ids = list(prompt)
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids", param="prompt")
        req = make_req(ids, params, rid or uuid.uuid4().hex, logprobs, self._limits(), bootstrap, priority)
        req.trace.received(arrival, trace)
        queue: asyncio.Queue[Delivery] = asyncio.Queue()
        deliver: Callable[[Delivery], None]
        if caller is engine_loop:
            deliver = queue.put_nowait
        else:
            def deliver(item: Delivery) -> None:
                if caller.is_closed():
                    raise ConnectionAbortedError("the caller's event loop is gone")
                caller.call_soon_threadsafe(queue.put_nowait, item)
        self._call_on_loop(self._register, req, deliver, stream)
        return req, queue

    def _register(self, req: Req, deliver: Callable[[Delivery], None], stream: bool) -> None:
        if req.rid in self.scheduler.reqs_by_rid:
            deliver(InvalidRequest(f"duplicate rid {req.rid}", param="rid"))
            return
        self.output.register(req, deliver, stream)
        self.scheduler.add_request(req)

    async def async_generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingInput = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        bootstrap: BootstrapInfo | None = None,
        trace: TraceOptions | None = None,
        logprob_start_len: int = -1,
        priority: int | None = None,
    ) -> GenerateOutput:
        """The whole output of one prompt. Cancelling the awaiting task aborts the request.
        `bootstrap`: on a prefill/decode server, where the KV goes or comes from.
        `trace`: return_trace, the caller's trace context and arrival (runtime/managers/trace.py).
        `logprob_start_len` >= 0 (with return_logprob): prompt logprobs too (LogprobOptions).
        `priority`: its rank under --schedule-policy priority (None: the default, 0)."""
        return await self._generate_one(prompt, sampling_params, rid, return_logprob, top_logprobs_num, bootstrap, trace,
                                        logprob_start_len, priority)

    async def async_generate_stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingInput = None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        bootstrap: BootstrapInfo | None = None,
        trace: TraceOptions | None = None,
        logprob_start_len: int = -1,
        priority: int | None = None,
    ) -> AsyncGenerator[GenerateOutput, None]:
        """The output of one prompt as delta chunks (io_struct); the last has finish_reason.
        Closing it early (aclose, break, cancelling the task) aborts the request."""
        logprobs = LogprobOptions(return_logprob, top_logprobs_num, logprob_start_len)
        req, queue = await self._submit(prompt, sampling_params, rid, True, logprobs, bootstrap, trace, priority)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, InvalidRequest):
                    raise item
                finished = item["meta_info"]["finish_reason"] is not None
                yield item
        finally:
            if not finished:
                self.abort(req.rid, why="stream_closed")

    async def _generate_one(
        self, prompt: Prompt, params: SamplingInput, rid: str | None, return_logprob: bool, top_k: int,
        bootstrap: BootstrapInfo | None = None, trace: TraceOptions | None = None, logprob_start_len: int = -1,
        priority: int | None = None,
    ) -> GenerateOutput:
        logprobs = LogprobOptions(return_logprob, top_k, logprob_start_len)
        req, queue = await self._submit(prompt, params, rid, False, logprobs, bootstrap, trace, priority)
        try:
            item = await queue.get()
        except asyncio.CancelledError:
            self.abort(req.rid, why="cancelled")
            raise
        if isinstance(item, InvalidRequest):
            raise item
        return item

    def generate(
        self,
        prompt: Prompt | list[str] | list[list[int]],
        sampling_params: SamplingInput | list[SamplingInput] = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        return_trace: bool = False,
        logprob_start_len: int | list[int] = -1,
        priority: int | list[int] | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        batched = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        prompts = cast(list[Prompt], list(prompt) if batched else [prompt])
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        starts = logprob_start_len if isinstance(logprob_start_len, list) else [logprob_start_len] * len(prompts)
        if len(params) != len(prompts) or len(starts) != len(prompts):
            raise InvalidRequest("sampling_params and logprob_start_len must match the number of prompts", param="sampling_params")
        priorities = priority if isinstance(priority, list) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidRequest("priority must match the number of prompts", param="priority")
        loop = self._ensure_started()

        async def run_all() -> list[GenerateOutput]:
            trace = TraceOptions(return_trace=True) if return_trace else None
            tasks = [asyncio.ensure_future(self._generate_one(p, sp, None, return_logprob, top_logprobs_num, None, trace, s, pr))
                     for p, sp, s, pr in zip(prompts, params, starts, priorities)]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                # One prompt failed (e.g. invalid params): the others must not run on
                # unseen. A cancelled _generate_one aborts its request.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        outs = asyncio.run_coroutine_threadsafe(run_all(), loop).result()
        return outs if batched else outs[0]

    def self_check_bootstrap(self) -> BootstrapInfo | None:
        """For the server's own requests (warm-up, /health_generate): on a prefill/decode
        server, SGLang's fake bootstrap host, so no peer is involved."""
        if self.settings.disaggregation_mode == "null":
            return None
        return BootstrapInfo(FAKE_BOOTSTRAP_HOST, 0, uuid.uuid4().int >> 64)

    def abort(self, rid: str, why: str = "abort_request") -> None:
        """Abort one request (no-op if unknown); `why` goes in its trace."""
        self._call_on_loop(self._abort, rid, why)

    def _abort(self, rid: str, why: str) -> None:
        req = self.scheduler.reqs_by_rid.get(rid)
        if req is not None and not req.to_abort and not req.finished():
            req.trace.abort_requested(why)
        self.scheduler.abort(rid)

    def abort_all(self) -> None:
        self._call_on_loop(self.scheduler.abort, None)

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
