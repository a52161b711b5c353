"""GrammarManager: the grammar_queue (SGLang's), where a request waits while its
output constraint compiles off the event loop.

Invariant: a request in `queue` holds nothing (no row, no KV, no prefix match);
`move_ready` hands on those whose grammar compiled (matcher attached) and ends
those whose grammar failed with a 400, so an invalid constraint never uses KV.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from runtime.constrained import GrammarBackend, InvalidGrammar
from runtime.managers.req import FinishReason, Req

if TYPE_CHECKING:
    import xgrammar

BAD_REQUEST = 400


class GrammarManager:
    def __init__(self, backend: GrammarBackend, finish: Callable[[Req, FinishReason], None], wake: Callable[[], None]) -> None:
        self.backend = backend
        self._finish = finish
        self._wake = wake
        self.queue: list[tuple[Req, Future[xgrammar.CompiledGrammar]]] = []

    def add(self, req: Req) -> bool:
        """False: `req` has no constraint or its grammar was cached (attached now): it
        goes on to the waiting queue. True: it waits here, or it already ended."""
        key = req.sampling_params.grammar
        if key is None:
            return False
        fut = self.backend.compile(key)
        if fut.done():
            return not self._settle(req, fut)
        loop = asyncio.get_running_loop()
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(self._wake))
        self.queue.append((req, fut))
        return True

    def move_ready(self) -> list[Req]:
        """Requests whose grammar is ready, in arrival order; failed ones end here."""
        if not self.queue or not any(fut.done() for _, fut in self.queue):
            return []
        ready, waiting = [], []
        for req, fut in self.queue:
            if not fut.done():
                waiting.append((req, fut))
            elif self._settle(req, fut):
                ready.append(req)
        self.queue = waiting
        return ready

    def abort(self, req: Req) -> bool:
        for i, (queued, _) in enumerate(self.queue):
            if queued is req:
                del self.queue[i]
                self._finish(req, FinishReason("abort", message="aborted"))
                return True
        return False

    def _settle(self, req: Req, fut: Future[xgrammar.CompiledGrammar]) -> bool:
        """Attach the compiled grammar (True) or end `req` with the compile error (False)."""
        try:
            compiled = fut.result()
        except InvalidGrammar as exc:
            self._finish(req, FinishReason("abort", message=str(exc), status_code=BAD_REQUEST))
            return False
        req.grammar = self.backend.matcher(compiled)
        # The grammar allows only its stop tokens once complete: they end the request
        # even under ignore_eos.
        req.stop_token_ids |= set(self.backend.stop_token_ids)
        return True
