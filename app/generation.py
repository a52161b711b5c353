"""GenerationGroup: the engine requests behind one HTTP request (n choices x prompts).

Each choice is one engine stream, pumped by its own task into a shared queue so
choices interleave as they are produced. Invariants:
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from app.errors import APIError, from_invalid_request
from app.state import AppState, Ticket
from runtime.errors import InvalidRequest

log = structlog.get_logger("sluice.app")

_DONE = object()


@dataclass(slots=True, eq=False)
class Choice:
    index: int
    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]
    last: dict[str, Any] | None = None  # latest chunk (cumulative fields)
    started: bool = False  # produced a chunk (or ended)
    finished: bool = False  # the engine reported finish_reason (or the stream ended)
    sent: dict[str, int] = field(default_factory=dict)  # formatter's cursor, e.g. logprobs sent

    def final(self) -> dict[str, Any]:
        """The last chunk; a stream that ended without any is reported as an abort."""
        if self.last is not None:
            return self.last
        meta = {"id": self.rid, "prompt_tokens": len(self.prompt_ids), "completion_tokens": 0, "cached_tokens": 0,
                "finish_reason": {"type": "abort", "matched": None}}
        return {"text": "", "delta": "", "output_ids": [], "meta_info": meta}


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
    ) -> None:
        self.state = state
        self.id = group_id
        self.choices = choices
        self._ticket = ticket
        self._arrival = arrival
        self._return_logprob = return_logprob
        self._top_logprobs_num = top_logprobs_num
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._ready: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(choices)  # choices whose pump has not ended
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
            self._tasks.append(asyncio.create_task(self._pump(engine, choice), name=f"sluice-pump-{choice.rid}"))

    async def _pump(self, engine: Any, choice: Choice) -> None:
        # Invariant: every pump puts exactly one terminal item (_DONE or an exception)
        # unless it is cancelled, so `_take` never waits on a pump that has ended.
        timer = self.state.metrics.timer(self._arrival)
        stream: Any = None
        try:
            stream = engine.async_generate(
                choice.prompt_ids,
                choice.params,
                stream=True,
                rid=choice.rid,
                return_logprob=self._return_logprob,
                top_logprobs_num=self._top_logprobs_num,
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
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - cleanup of an already-failed stream
                    log.debug("engine stream aclose failed", rid=choice.rid, exc_info=True)

    def _mark_started(self, choice: Choice) -> None:
        if not choice.started:
            choice.started = True
            self.state.not_started -= 1

    async def _take(self) -> tuple[int, dict[str, Any]] | None:
        """The next chunk of any choice; None once every choice has ended."""
        while self._open > 0:
            index, item = await self._queue.get()
            choice = self.choices[index]
            if item is _DONE:
                self._open -= 1
                choice.finished = True
                self._mark_started(choice)
                continue
            if isinstance(item, BaseException):
                self._open -= 1
                self._mark_started(choice)
                if isinstance(item, InvalidRequest):
                    raise from_invalid_request(item) from item
                raise item
            self._mark_started(choice)
            choice.last = item
            if (item.get("meta_info") or {}).get("finish_reason") is not None:
                choice.finished = True
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

    async def events(self) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """Every chunk of every choice, in arrival order (prefetched ones first)."""
        while self._ready:
            yield self._ready.popleft()
        while (item := await self._take()) is not None:
            yield item

    async def results(self) -> list[dict[str, Any]]:
        """Run every choice to the end; the final chunk of each, by index."""
        async for _ in self.events():
            pass
        return [c.final() for c in self.choices]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        engine = self.state.engine
        if self._launched:
            for choice in self.choices:
                if not choice.finished and engine is not None:
                    engine.abort(choice.rid)
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
