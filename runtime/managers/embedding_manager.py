"""Embedding requests on the scheduler side: SGLang's embedding path.

On an --is-embedding server every request is an `EmbeddingReq`. It is admitted and
chunked like any prompt, but it never decodes: the result of its last chunk ends it
(`finish` gives back its row and KV, or donates the KV to the radix cache with last
pooling), and its one output carries the pooled, L2-normalized vector.

Invariants:
- An EmbeddingReq never joins the running batch: its params reserve one new token
  (max_new_tokens=1), so the overlap filter `drop_reqs_ending_in_flight` drops it and
  without overlap its result has finished it before the batch merges.
- A request's partials (pooler.py) arrive in chunk order, one per forward, since the
  worker runs forwards in launch order and results are processed in that order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypedDict, cast, get_args

import torch

from config.settings import EngineSettings
from runtime.managers.io_struct import MetaInfo
from runtime.managers.req import FinishReason, Req
from runtime.managers.schedule_batch import ScheduleBatch
from runtime.managers.scheduler_output import OutputProcessor, Sink
from runtime.model_executor.pooler import EmbeddingResult, PoolingMethod
from runtime.sampling_params import SamplingParams


class EmbeddingParams(SamplingParams):
    """The params of an embedding request (`EMBEDDING`): one reserved step, never taken."""

    __slots__ = ()


EMBEDDING = EmbeddingParams(max_new_tokens=1, temperature=0.0)


class EmbeddingOutput(TypedDict):
    """An embedding request's one output (SGLang's /encode shape)."""

    embedding: list[float] | None  # L2-normalized; None if the request was aborted
    meta_info: MetaInfo  # completion_tokens is 0; finish_reason is length (done) or abort


class EmbeddingReq(Req):
    """A prompt to embed: prefilled (in chunks when long), pooled, finished right after."""

    def __init__(self, rid: str, input_ids: list[int]) -> None:
        super().__init__(rid, input_ids, EMBEDDING)
        self.pooled: torch.Tensor | None = None  # the partials combined so far ([hidden] float32)
        self.embedding: list[float] | None = None  # the normalized result, once its last chunk ran


class EmbeddingManager:
    def __init__(self, method: str, finish: Callable[[Req, FinishReason, int], None]) -> None:
        assert method in get_args(PoolingMethod), f"pooling={method!r}: resolve_pooling first"
        self.method = method
        self.finish = finish  # Scheduler.finish

    def _absorb(self, req: EmbeddingReq, partial: torch.Tensor) -> None:
        if self.method == "mean":
            req.pooled = partial.clone() if req.pooled is None else req.pooled + partial
        elif self.method == "last" or req.pooled is None:  # cls: the first chunk's (position 0)
            req.pooled = partial

    def _embedding(self, req: EmbeddingReq) -> list[float]:
        assert req.pooled is not None
        pooled = req.pooled / len(req.origin_input_ids) if self.method == "mean" else req.pooled
        return torch.nn.functional.normalize(pooled.double(), dim=0).float().tolist()  # float32 values, as OpenAI's

    def process(self, batch: ScheduleBatch, result: EmbeddingResult) -> None:
        """Scheduler.process_batch_result for an embedding server's batch."""
        n_extend = batch.batch_size() - len(batch.decoding_reqs)
        assert n_extend == batch.batch_size() == result.partials.shape[0], "an embedding server only extends"
        for i, req in enumerate(batch.reqs):
            req = cast(EmbeddingReq, req)
            if req.finished():  # aborted while a chunk was chunked_req; everything is released
                continue
            self._absorb(req, result.partials[i])
            if req.is_chunked > 0:
                req.is_chunked -= 1
                continue
            req.has_prefilled = True
            req.trace.prefilled()
            req.first_token_time = time.monotonic()  # (the "first token" of an embedding is its vector)
            if req.to_abort:
                reason = req.abort_reason or FinishReason("abort", message="aborted")
            else:
                req.embedding = self._embedding(req)
                reason = FinishReason("length", 0)
            # Its forward wrote KV for the whole prompt, seq_lens[i] tokens.
            self.finish(req, reason, batch.seq_lens[i])


class EmbeddingOutputProcessor(OutputProcessor):
    """Hands each embedding request its one output when it finishes (no text, no stream)."""

    def register(self, req: Req, sink: Sink, stream: bool) -> None:
        self.sinks[req.rid] = (sink, False)

    def matched_stop(self, req: Req) -> str | None:
        return None

    def emit(self, req: Req) -> bool:
        if not req.finished():
            return True
        entry = self.sinks.pop(req.rid, None)
        if entry is None:
            return True
        req.finished_time = time.monotonic()
        out: EmbeddingOutput = {
            "embedding": cast(EmbeddingReq, req).embedding,
            "meta_info": self._chunk(req, "", 0)["meta_info"],
        }
        sink = cast(Callable[[EmbeddingOutput], None], entry[0])  # an embedding engine's sinks take these
        try:
            sink(out)
        except Exception:  # the consumer is gone
            return False
        return True


def output_processor(settings: EngineSettings, tokenizer: Any) -> OutputProcessor:
    """The engine's output processor: text chunks, or on an embedding server one vector each."""
    if settings.is_embedding:
        return EmbeddingOutputProcessor(tokenizer)
    return OutputProcessor(tokenizer, settings.stream_interval)
