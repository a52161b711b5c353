"""ModelRunner: the worker. ModelWorkerBatch -> ForwardBatch -> model -> sampler.

Runs on the worker executor (one thread), so forwards execute strictly in launch
order. It owns the worker's copy of req_to_token and applies each batch's writes
before its forward; that ordering is what makes scheduler-side reuse of rows and
slots safe while a forward is in flight.
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.forward_batch import ForwardBatch, ForwardMode
from runtime.future_map import FutureMap
from runtime.mem.kv_pool import KVPool
from runtime.sampler import Sampler
from runtime.schedule_batch import ModelWorkerBatch
from runtime.scheduler_output import BatchResult


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        attn_backend: Any,
        num_rows: int,
        context_len: int,
        vocab_size: int,
        device: torch.device | str,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((num_rows, context_len), dtype=torch.int32, device=self.device)
        self.sampler = Sampler(num_rows, vocab_size, self.device)
        self.futures: FutureMap | None = None

    def attach_future_map(self, futures: FutureMap) -> None:
        self.futures = futures

    def _write_req_to_token(self, mwb: ModelWorkerBatch, out_cache_loc: torch.Tensor) -> None:
        table, start = self.req_to_token, 0
        decode_rows, decode_pos, decode_tok = [], [], []
        for i, (row, p, n) in enumerate(zip(mwb.req_pool_indices, mwb.extend_prefix_lens, mwb.extend_seq_lens)):
            slots = mwb.prefix_slots[i]
            if slots is None:
                decode_rows.append(row)
                decode_pos.append(p)
                decode_tok.append(start)
            else:
                if p:
                    table[row, :p] = slots.to(self.device, torch.int32)
                table[row, p : p + n] = out_cache_loc[start : start + n].to(torch.int32)
            start += n
        if decode_rows:
            dev = self.device
            table[torch.tensor(decode_rows, device=dev), torch.tensor(decode_pos, device=dev)] = out_cache_loc[
                torch.tensor(decode_tok, device=dev)
            ].to(torch.int32)

    def build_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch:
        dev = self.device
        assert self.futures is not None
        input_ids = self.futures.resolve(mwb.input_ids.to(dev, non_blocking=True))
        out_cache_loc = mwb.out_cache_loc.to(dev, non_blocking=True)
        self._write_req_to_token(mwb, out_cache_loc)
        prefix = torch.tensor(mwb.extend_prefix_lens, dtype=torch.int64, device=dev)
        ext = torch.tensor(mwb.extend_seq_lens, dtype=torch.int64, device=dev)
        if mwb.forward_mode.is_decode():
            positions = prefix
        else:
            starts = torch.cumsum(ext, 0) - ext
            positions = torch.arange(int(sum(mwb.extend_seq_lens)), device=dev) + torch.repeat_interleave(prefix - starts, ext)
        fb = ForwardBatch(
            forward_mode=mwb.forward_mode,
            batch_size=len(mwb.req_pool_indices),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=torch.tensor(mwb.req_pool_indices, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(mwb.seq_lens, dtype=torch.int64, device=dev),
            extend_prefix_lens=prefix,
            extend_seq_lens=ext,
            seq_lens_cpu=mwb.seq_lens,
            extend_prefix_lens_cpu=mwb.extend_prefix_lens,
            extend_seq_lens_cpu=mwb.extend_seq_lens,
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
        )
        self.attn_backend.init_forward_metadata(fb)
        return fb

    @torch.inference_mode()
    def forward_logits(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(fb.input_ids, fb.positions, fb)
        if fb.forward_mode.is_decode():
            last = hidden
        else:
            last = hidden[torch.cumsum(fb.extend_seq_lens, 0) - 1]
        return self.model.compute_logits(last)

    @torch.inference_mode()
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> BatchResult:
        fb = self.build_forward_batch(mwb)
        logits = self.forward_logits(fb)
        out = self.sampler(logits, mwb.sampling, mwb.top_logprobs_nums)
        assert self.futures is not None
        self.futures.store(mwb.future_ids, out.next_token_ids)
        # The one host sync of a step: the scheduler needs the tokens as ints.
        return BatchResult(
            next_token_ids=out.next_token_ids.tolist(),
            token_logprobs=None if out.token_logprobs is None else out.token_logprobs.tolist(),
            top_logprobs=None if out.top_logprobs is None else out.top_logprobs.tolist(),
            top_ids=None if out.top_ids is None else out.top_ids.tolist(),
        )


__all__ = ["ModelRunner", "ForwardMode"]
