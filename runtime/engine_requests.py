"""Engine's request room: a prompt's way in (tokenize, validate, register with the
scheduler) and its outputs' way back to the caller, on whichever loop the caller runs.
Engine (runtime/engine.py) owns one and hands out its calls as its own.

A request enters the scheduler only through `_register`, on the engine's loop. From then
on the output processor hands its chunks to the request's `deliver` (every chunk when
streamed, only the final one otherwise); a `deliver` that raises (the caller's loop is
gone) makes the scheduler abort the request, as does abandoning the wait (cancelling the
awaiting task, closing a stream early).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, cast

from config.settings import EngineSettings
from runtime import disaggregation
from runtime.errors import InvalidRequest
from runtime.managers.embedding_manager import EMBEDDING, EmbeddingOutput
from runtime.managers.io_struct import FAKE_BOOTSTRAP_HOST, BootstrapInfo, GenerateOutput
from runtime.managers.req import Req
from runtime.managers.scheduler import Scheduler
from runtime.managers.scheduler_output import OutputProcessor
from runtime.managers.tokenizer_manager import LogprobOptions, RequestLimits, SamplingInput, make_req
from runtime.managers.trace import TraceOptions
from runtime.mem.pools import MemoryPools
from runtime.model_config import ModelConfig
from runtime.model_executor.worker import Worker
from runtime.token_roles import TokenPrompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Prompt = str | list[int] | TokenPrompt  # a text, token ids, or token ids with earlier answers marked
Delivery = GenerateOutput | InvalidRequest  # what a request's queue carries to its caller


class OutputStream:
    """One streamed request's delta chunks, read with `next()` by one caller at a time.
    Unlike `async_generate_stream`'s generator, a `next()` cancelled mid-wait aborts
    nothing: whoever abandons the stream aborts the request (`Engine.abort(rid, why)`)
    with its own reason. A caller reads it without a generator frame per chunk."""

    __slots__ = ("rid", "finished", "_queue")

    def __init__(self, rid: str, queue: asyncio.Queue[Delivery]) -> None:
        self.rid = rid
        self.finished = False  # the chunk with finish_reason was read
        self._queue = queue

    async def next(self) -> GenerateOutput | None:
        """The next chunk; None once the one with finish_reason has been read. Raises the
        request's InvalidRequest (it never entered the scheduler)."""
        if self.finished:
            return None
        item = await self._queue.get()
        if isinstance(item, InvalidRequest):
            raise item
        self.finished = item["meta_info"]["finish_reason"] is not None
        return item


class RequestRoom:
    """Engine's generate / encode / abort calls over its scheduler. `ensure_started` starts
    the engine's loop once and returns it; `call_on_loop(fn, *args)` runs fn on it."""

    def __init__(
        self,
        settings: EngineSettings,
        model_config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase,
        pools: MemoryPools,
        worker: Worker,
        scheduler: Scheduler,
        output: OutputProcessor,
        ensure_started: Callable[[], asyncio.AbstractEventLoop],
        call_on_loop: Callable[..., None],
    ) -> None:
        self.settings, self.model_config, self.tokenizer = settings, model_config, tokenizer
        self.pools, self.worker, self.scheduler, self.output = pools, worker, scheduler, output
        self._ensure_started, self._call_on_loop = ensure_started, call_on_loop
        self._tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sluice-tokenize")

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False)

    def _tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt))  # with the model's BOS, as HF/vLLM/SGLang do

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
            prompt = TokenPrompt(await caller.run_in_executor(self._tokenize_pool, self._tokenize, prompt))
        elif isinstance(prompt, list):
            prompt = TokenPrompt(list(prompt))
        elif not isinstance(prompt, TokenPrompt):
            raise InvalidRequest("prompt must be a string or a list of token ids", param="prompt")
        req = make_req(prompt, params, rid or uuid.uuid4().hex, logprobs, self._limits(), bootstrap, priority)
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
        stream = await self.open_stream(prompt, sampling_params, rid, return_logprob, top_logprobs_num, bootstrap, trace,
                                        logprob_start_len, priority)
        try:
            while (item := await stream.next()) is not None:
                yield item
        finally:
            if not stream.finished:
                self.abort(stream.rid, why="stream_closed")

    async def open_stream(
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
    ) -> OutputStream:
        """`async_generate_stream`'s request, submitted, as an OutputStream (see there)."""
        logprobs = LogprobOptions(return_logprob, top_logprobs_num, logprob_start_len)
        req, queue = await self._submit(prompt, sampling_params, rid, True, logprobs, bootstrap, trace, priority)
        return OutputStream(req.rid, queue)

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
        prompt: Prompt | list[str] | list[list[int]] | list[TokenPrompt],
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

    # ---- embeddings (an --is-embedding engine; on a generation engine both raise InvalidRequest) ----
    # An embedding request travels the generation path with `EMBEDDING` as its params:
    # `make_req` turns it into an EmbeddingReq, the scheduler ends it after its prefill
    # (runtime/managers/embedding_manager.py), and its one output carries the pooled,
    # L2-normalized vector instead of text.
    async def async_encode(self, prompt: Prompt, rid: str | None = None) -> EmbeddingOutput:
        """The embedding of one prompt (text, tokenized with the model's special tokens,
        or token ids). Cancelling the awaiting task aborts the request."""
        return cast(EmbeddingOutput, await self._generate_one(prompt, EMBEDDING, rid, False, 0))

    def encode(self, prompt: Prompt | list[str] | list[list[int]]) -> EmbeddingOutput | list[EmbeddingOutput]:
        """One prompt's embedding, or a list for a batch (a list of texts or token-id lists)."""
        return cast(EmbeddingOutput | list[EmbeddingOutput], self.generate(prompt, EMBEDDING))
