"""LogitsProcessor: hidden states -> full-vocab float32 logits on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed.parallel_state import tensor_model_parallel_all_gather
from runtime.layers.batch_invariant import batch_invariant_linear
from runtime.layers.vocab_embedding import VocabParallelEmbedding

if TYPE_CHECKING:
    from kernels.cpu import CpuOps
    from runtime.layers.quantization.q8 import Q8Weight


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        # Set by runtime.models.cpu_path: the head as exact Q8 blocks and the kernel that
        # reads them (float activations, or on AVX512-VNNI / AVX2 16-bit fixed-point ones as the
        # q4q8 linears; per-row order, so batch-invariant too); or fixed row blocks.
        self.ops: CpuOps | None = None
        self.q8: Q8Weight | None = None
        # or, beside q4q8 linears, only pack_q8_vnni's records of those blocks (`q8` is then
        # None: its 31 MB would be dead weight)
        self.q8_vnni: torch.Tensor | None = None
        # and what f32_linear takes from `panels_min_rows` rows on: beside q4q8 linears that
        # run big batches on panels, pack_f32_panels of its weight or, past the float32
        # budget, `q8_vnni` itself (dequantized as it goes); not under deterministic
        # inference: a row's kernel would depend on the batch. For a float32 model, panels
        # of its weight.
        self.panels: torch.Tensor | None = None
        self.panels_min_rows = 0
        # (an unquantized model's panels take every row count: a row's kernel never depends
        # on the batch, so they stay under deterministic inference too)
        self.panels_batch_invariant = False
        self.batch_invariant = False

    def forward(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding) -> torch.Tensor:
        """`[T, hidden]` -> `[T, vocab]` float32. Each rank computes its vocab shard's
        logits; the all-gather concatenates them in rank order (= vocab order), so every
        rank, rank 0's sampler included, sees the whole row. Padding columns are cut."""
        invariant_ok = self.panels_batch_invariant or not self.batch_invariant
        if self.ops is not None and self.panels is not None and invariant_ok and hidden.shape[0] >= self.panels_min_rows:
            local = self.ops.f32_linear(hidden.float(), self.panels)
        elif self.ops is not None and self.q8_vnni is not None:
            local = self.ops.q8_linear_vnni(hidden.float(), self.q8_vnni)
        elif self.ops is not None and self.q8 is not None:
            local = self.ops.q8_linear(hidden.float(), self.q8.qw, self.q8.scales)
        elif self.batch_invariant:
            local = batch_invariant_linear(hidden, lm_head.weight)
        else:
            local = F.linear(hidden, lm_head.weight)
        logits = tensor_model_parallel_all_gather(local, dim=-1)
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size].contiguous()
        return logits.float()
