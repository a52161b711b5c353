"""What comes back from a forward (BatchResult) and what goes out to callers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.detokenizer import IncrementalDetokenizer
from runtime.req import FinishReason, Req


@dataclass(slots=True)
class BatchResult:
    next_token_ids: list[int]  # [bs]
    token_logprobs: list[float] | None = None  # [bs]
    top_logprobs: list[list[float]] | None = None  # [bs][k]
    top_ids: list[list[int]] | None = None

    def append_logprobs(self, req: Req, i: int) -> None:
        if self.token_logprobs is None:
            return
        req.output_token_logprobs.append((self.token_logprobs[i], self.next_token_ids[i]))
        if req.top_logprobs_num > 0 and self.top_logprobs is not None and self.top_ids is not None:
            k = req.top_logprobs_num
            req.output_top_logprobs.append(list(zip(self.top_logprobs[i][:k], self.top_ids[i][:k])))


Sink = Callable[[dict[str, Any]], None]


class OutputProcessor:
    """Detokenizes, applies stop strings and hands chunks to each request's sink.

    Runs on the scheduler's loop right after a result is processed, so a stop
    string finishes the request before its KV is released.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.sinks: dict[str, tuple[Sink, bool]] = {}

    def register(self, req: Req, sink: Sink, stream: bool) -> None:
        sp = req.sampling_params
        self.detoks[req.rid] = IncrementalDetokenizer(
            self.tokenizer,
            req.origin_input_ids,
            sp.stop,
            sp.skip_special_tokens,
            sp.spaces_between_special_tokens,
            sp.no_stop_trim,
        )
        self.sinks[req.rid] = (sink, stream)

    def step(self, req: Req) -> None:
        """Check stop strings after a new token. Without stop strings nothing is
        decoded here: text is only needed when a chunk is emitted."""
        detok = self.detoks.get(req.rid)
        if detok is None or not detok.stop:
            return
        detok.feed(req.output_ids, check_stop=len(req.output_ids) >= req.sampling_params.min_new_tokens)
        if detok.matched_stop is not None and not req.finished():
            req.finished_reason = FinishReason("stop", detok.matched_stop)

    def emit(self, req: Req) -> None:
        entry = self.sinks.get(req.rid)
        if entry is None:
            return
        sink, stream = entry
        finished = req.finished()
        if not (stream or finished):
            return
        detok = self.detoks[req.rid]
        detok.feed(req.output_ids, check_stop=len(req.output_ids) >= req.sampling_params.min_new_tokens)
        delta = detok.release(finished)
        if finished:
            req.finished_time = time.monotonic()
            self.sinks.pop(req.rid, None)
            self.detoks.pop(req.rid, None)
        try:
            sink(self._chunk(req, detok.output_text, delta))
        except Exception:  # the consumer is gone: stop generating for it
            if not finished:
                req.to_abort = True
                del self.sinks[req.rid]

    @staticmethod
    def _chunk(req: Req, text: str, delta: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finished_reason.to_json() if req.finished_reason else None,
            "queue_time": (req.first_scheduled_time or time.monotonic()) - req.arrival_time,
            "first_token_time": None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            "e2e_latency": None if req.finished_time is None else req.finished_time - req.arrival_time,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = list(req.output_token_logprobs)
            if req.top_logprobs_num > 0:
                meta["output_top_logprobs"] = list(req.output_top_logprobs)
        return {"text": text, "delta": delta, "output_ids": list(req.output_ids), "meta_info": meta}
