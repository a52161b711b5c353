"""GenerationGroup: the engine requests behind one HTTP request (n choices x prompts).

Each choice is one engine stream. Several choices are pumped by a task each into a
shared queue, so they interleave as they are produced; a lone choice (the common case)
is read straight from its engine OutputStream, without a pump's task switch, queue and
generator frames per token. Invariants:
- `start()` returns only once every choice has produced its first chunk, so an
  engine validation error (raised on first iteration, nothing queued) becomes a
  4xx before any response header is sent.
- `close()` is synchronous and idempotent and runs on every exit path (finished,
  client gone, error, server shutdown): it cancels the pumps and aborts every
  choice the engine has not finished, so KV is freed at the next scheduler round.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from app.errors import APIError, from_invalid_request
from app.metrics import RequestTimer
from app.state import AppState, Ticket
from runtime.errors import InvalidRequest
from runtime.managers.io_struct import BootstrapInfo, GenerateOutput, MetaInfo, PromptTokenLogprob, TokenLogprob
from runtime.managers.trace import TraceOptions
from runtime.sampling_params import SamplingParams
from runtime.token_roles import Span, TokenPrompt

if TYPE_CHECKING:
    from runtime import Engine
    from runtime.engine_requests import OutputStream

log = structlog.get_logger("sluice.app")


class _Done:
    """A pump's end-of-stream marker."""


_DONE = _Done()


@dataclass(slots=True, eq=False)
class Choice:
    """One engine request and its output so far: the sum of the engine's delta chunks,
    each appended once (texts are joined when read), so keeping it costs O(output)."""

    index: int
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: BootstrapInfo | None = None  # prefill/decode disaggregation
    logprob_start_len: int = -1  # >= 0: the engine reports the prompt's logprobs from there on
    priority: int | None = None  # None: not given (the engine's default)
    answer_spans: tuple[Span, ...] = ()  # earlier answers in the prompt (runtime/token_roles.py)
    text_parts: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    # Prompt logprobs arrive once, in the engine's first chunk, and are kept as soon as it
    # arrives (GenerationGroup._take): `start()` returning means they are here.
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)
    prompt_top_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    meta: MetaInfo | None = None  # of the latest chunk
    started: bool = False  # produced a chunk (or ended)
    finished: bool = False  # the engine reported finish_reason (or the stream ended)

    @property
    def text(self) -> str:
        if len(self.text_parts) > 1:
            self.text_parts[:] = ["".join(self.text_parts)]
        return self.text_parts[0] if self.text_parts else ""

    def absorb(self, chunk: GenerateOutput) -> None:
        meta = chunk["meta_info"]
        self.text_parts.append(chunk["text"])
        self.output_ids.extend(chunk["output_ids"])
        self.token_logprobs.extend(meta.get("output_token_logprobs", ()))
        self.top_logprobs.extend(meta.get("output_top_logprobs", ()))
        self.meta = meta

    def final_meta(self) -> MetaInfo:
        """The latest meta_info; a stream that ended without any chunk is reported as an abort."""
        if self.meta is not None:
            return self.meta
        return {"id": self.rid, "prompt_tokens": len(self.prompt_ids), "completion_tokens": 0, "cached_tokens": 0,
                "finish_reason": {"type": "abort", "matched": None}, "queue_time": 0.0, "first_token_time": None,
                "e2e_latency": None}

    def cumulative(self) -> GenerateOutput:
        """The whole output so far, logprob lists included (SGLang's native shape)."""
        meta = self.final_meta().copy()
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = list(self.token_logprobs)
        if "output_top_logprobs" in meta:
            meta["output_top_logprobs"] = list(self.top_logprobs)
        if "input_token_logprobs" in meta:
            meta["input_token_logprobs"] = list(self.prompt_logprobs)
        if "input_top_logprobs" in meta:
            meta["input_top_logprobs"] = list(self.prompt_top_logprobs)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class GenerationGroup:
    def __init__(
        self,
        state: AppState,
        group_id: str,
        choices: list[Choice],
        ticket: Ticket,
        *,
        arrival: float,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        trace: TraceOptions | None = None,
    ) -> None:
        self.state = state
        self.id = group_id
        self.choices = choices
        self._ticket = ticket
        self._arrival = arrival
        self._return_logprob = return_logprob
        self._top_logprobs_num = top_logprobs_num
        self._trace = trace
        self._queue: asyncio.Queue[tuple[int, GenerateOutput | _Done | Exception]] = asyncio.Queue()
        self._ready: collections.deque[tuple[int, GenerateOutput]] = collections.deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._lone: tuple[Engine, RequestTimer] | None = None  # a lone choice, read by _next_item
        self._lone_stream: OutputStream | None = None  # its request, once submitted
        self._open = len(choices)  # choices whose stream has not ended
        self._launched = False
        self._closed = False

    def launch(self) -> None:
        engine = self.state.ready_engine()
        for choice in self.choices:
            if choice.rid in self.state.rids:
                raise APIError(400, f"Request id {choice.rid!r} is already in use.", param="rid")
        self.state.groups[self.id] = self
        self._launched = True
        for choice in self.choices:
            self.state.rids.add(choice.rid)
            self.state.not_started += 1
        if len(self.choices) == 1:  # submitted at its first read (start / run_to_end)
            self._lone = (engine, self.state.metrics.timer(self._arrival))
            return
        for choice in self.choices:
            self._tasks.append(asyncio.create_task(self._pump(engine, choice), name=f"sluice-pump-{choice.rid}"))

    async def _pump(self, engine: Engine, choice: Choice) -> None:
        # Invariant: every pump puts exactly one terminal item (_DONE or an exception)
        # unless it is cancelled, so `_take` never waits on a pump that has ended.
        timer = self.state.metrics.timer(self._arrival)
        stream: AsyncGenerator[GenerateOutput, None] | None = None
        try:
            stream = engine.async_generate_stream(
                TokenPrompt(choice.prompt_ids, choice.answer_spans),
                choice.params,
                rid=choice.rid,
                return_logprob=self._return_logprob,
                top_logprobs_num=self._top_logprobs_num,
                bootstrap=choice.bootstrap,
                trace=self._trace,
                logprob_start_len=choice.logprob_start_len,
                priority=choice.priority,
            )
            async for chunk in stream:
                timer.on_chunk(chunk)
                self._queue.put_nowait((choice.index, chunk))
            self._queue.put_nowait((choice.index, _DONE))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which decides the status
            self._queue.put_nowait((choice.index, exc))
        finally:
            if stream is not None:
                try:
                    await stream.aclose()
                except Exception:  # noqa: BLE001 - cleanup of an already-failed stream
                    log.debug("engine stream aclose failed", rid=choice.rid, exc_info=True)

    def _mark_started(self, choice: Choice) -> None:
        if not choice.started:
            choice.started = True
            self.state.not_started -= 1

    async def _next_item(self) -> tuple[int, GenerateOutput | _Done | Exception]:
        """What a pump would queue next: a chunk, _DONE or the stream's exception. A lone
        choice's read cancelled mid-wait aborts nothing itself: `close` does, with its why."""
        if self._lone is None:
            return await self._queue.get()
        engine, timer = self._lone
        try:
            if self._lone_stream is None:
                choice = self.choices[0]
                self._lone_stream = await engine.open_stream(
                    TokenPrompt(choice.prompt_ids, choice.answer_spans), choice.params, rid=choice.rid,
                    return_logprob=self._return_logprob, top_logprobs_num=self._top_logprobs_num,
                    bootstrap=choice.bootstrap, trace=self._trace, logprob_start_len=choice.logprob_start_len,
                    priority=choice.priority,
                )  # fmt: skip
            chunk = await self._lone_stream.next()
        except Exception as exc:  # noqa: BLE001 - handed to _take, which decides the status
            return 0, exc
        if chunk is None:
            return 0, _DONE
        timer.on_chunk(chunk)
        return 0, chunk

    async def _take(self) -> tuple[int, GenerateOutput] | None:
        """The next chunk of any choice; None once every choice has ended."""
        while self._open > 0:
            index, item = await self._next_item()
            choice = self.choices[index]
            if isinstance(item, _Done):
                self._open -= 1
                choice.finished = True
                self._mark_started(choice)
                continue
            if isinstance(item, Exception):
                self._open -= 1
                self._mark_started(choice)
                if isinstance(item, InvalidRequest):
                    raise from_invalid_request(item) from item
                raise item
            self._mark_started(choice)
            choice.prompt_logprobs.extend(item["meta_info"].get("input_token_logprobs", ()))
            choice.prompt_top_logprobs.extend(item["meta_info"].get("input_top_logprobs", ()))
            reason = item["meta_info"]["finish_reason"]
            if reason is not None:
                choice.finished = True
                if "status_code" in reason:  # the server ended it (e.g. its KV transfer failed)
                    raise APIError(reason["status_code"], reason.get("message") or "the request failed")
            return index, item
        return None

    async def start(self) -> None:
        """Wait until every choice has produced output (or failed: then close and raise)."""
        try:
            while not all(c.started for c in self.choices):
                item = await self._take()
                if item is None:
                    break
                self._ready.append(item)
        except BaseException:
            self.close()
            raise

    async def events(self) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """Every delta chunk of every choice, in arrival order (prefetched ones first).
        Invariant: when a chunk is yielded, its choice has absorbed exactly the chunks
        yielded so far, so `Choice` totals line up with the stream."""
        while self._ready:
            index, chunk = self._ready.popleft()
            self.choices[index].absorb(chunk)
            yield index, chunk
        while (item := await self._take()) is not None:
            self.choices[item[0]].absorb(item[1])
            yield item

    async def run_to_end(self) -> None:
        """Absorb every choice's output to the end."""
        async for _ in self.events():
            pass

    def close(self, why: str = "response_closed") -> None:
        """`why`: what ended the response early, for the traces of the choices it aborts."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        engine = self.state.engine
        if self._launched:
            for choice in self.choices:
                if not choice.finished and engine is not None:
                    engine.abort(choice.rid, why=why)
                self._mark_started(choice)
                self.state.rids.discard(choice.rid)
            if self.state.groups.get(self.id) is self:
                del self.state.groups[self.id]
        self._ticket.release()

    def abort(self) -> None:
        """Ask the engine to end every choice; each stream then ends with finish_reason abort."""
        engine = self.state.ready_engine()
        for choice in self.choices:
            if not choice.finished:
                engine.abort(choice.rid)
