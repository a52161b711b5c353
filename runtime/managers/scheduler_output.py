"""OutputProcessor: what goes out to callers (detokenized chunks through each request's sink)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from runtime.managers.detokenizer import IncrementalDetokenizer
from runtime.managers.io_struct import GenerateOutput, MetaInfo
from runtime.managers.req import Req

Sink = Callable[[GenerateOutput], None]


class OutputProcessor:
    """Detokenizes, applies stop strings and hands chunks to each request's sink.

    Runs on the scheduler's loop right after a result is processed, so a stop
    string finishes the request before its KV is released.
    """

    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval  # a streamed request's tokens per chunk (SGLang's)
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

    def matched_stop(self, req: Req) -> str | None:
        """The stop string the output now ends in, if any (after a new token). Without
        stop strings nothing is decoded here: text is only needed when a chunk is emitted."""
        detok = self.detoks.get(req.rid)
        if detok is None or not detok.stop:
            return None
        detok.feed(req.output_ids, check_stop=len(req.output_ids) >= req.sampling_params.min_new_tokens)
        return detok.matched_stop

    def emit(self, req: Req) -> bool:
        """Hand the request's new output to its sink. False if the consumer is gone
        (the scheduler then aborts the request)."""
        entry = self.sinks.get(req.rid)
        if entry is None:
            return True
        sink, stream = entry
        finished = req.finished()
        if not (stream or finished):
            return True
        n = len(req.output_ids)
        if not finished and n > 1 and n % self.stream_interval:  # the first token goes out at once
            return True
        detok = self.detoks[req.rid]
        detok.feed(req.output_ids, check_stop=n >= req.sampling_params.min_new_tokens)
        text = detok.release(finished)
        # Chunks are deltas (io_struct): tokens [start, now) have not been handed out yet.
        start, detok.ids_sent = detok.ids_sent, n
        if finished:
            req.finished_time = time.monotonic()
            self.sinks.pop(req.rid, None)
            self.detoks.pop(req.rid, None)
        try:
            sink(self._chunk(req, text, start))
        except Exception:  # the consumer is gone
            self.sinks.pop(req.rid, None)
            return False
        return True

    @staticmethod
    def _chunk(req: Req, text: str, start: int) -> GenerateOutput:
        """The output of `req` from output token `start` on, with `text` released since the last chunk."""
        meta: MetaInfo = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finished_reason.to_json() if req.finished_reason else None,
            "queue_time": (req.first_scheduled_time or time.monotonic()) - req.arrival_time,
            "first_token_time": None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            "e2e_latency": None if req.finished_time is None else req.finished_time - req.arrival_time,
        }
        if req.finished_reason is not None and req.trace.options.return_trace:
            meta["trace"] = req.trace.to_json(len(req.output_ids))
        if req.return_logprob:
            meta["output_token_logprobs"] = req.output_token_logprobs[start:]
            if req.top_logprobs_num > 0:
                meta["output_top_logprobs"] = req.output_top_logprobs[start:]
        if req.prompt_logprobs is not None:  # the whole list once it is complete (then [] again)
            meta["input_token_logprobs"], tops = req.prompt_logprobs.take(req.origin_input_ids)
            if req.top_logprobs_num > 0:
                meta["input_top_logprobs"] = tops
        return {"text": text, "output_ids": req.output_ids[start:], "meta_info": meta}
