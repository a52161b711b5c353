"""LogitsProcessor: hidden states -> full-vocab float32 logits on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed.parallel_state import tensor_model_parallel_all_gather
from runtime.layers.vocab_embedding import VocabParallelEmbedding


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding) -> torch.Tensor:
        """`[T, hidden]` -> `[T, vocab]` float32. Each rank computes its vocab shard's
        logits; the all-gather concatenates them in rank order (= vocab order), so every
        rank, rank 0's sampler included, sees the whole row. Padding columns are cut."""
        logits = tensor_model_parallel_all_gather(F.linear(hidden, lm_head.weight), dim=-1)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size].contiguous()
        return logits.float()
