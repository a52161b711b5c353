"""Token embedding and LM head with the vocabulary split over tensor-parallel ranks.

Rank r holds vocab rows `[vocab_start_index, vocab_end_index)`, a shard of
`ceil(vocab / tp_size)` rows; when tp_size does not divide the vocab, the last
rank's rows past the vocab are padding: zero, never looked up, and their logits are
sliced off after the gather (runtime/layers/logits_processor.py). At tp_size 1 the
shard is the whole vocab, with no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from runtime.layers.weights import LazyWeight, ShardId, copy_into, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = min(self.tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, self.weight_loader, {None: (num_embeddings, embedding_dim)})

    def weight_loader(self, param: nn.Parameter, loaded_weight: LazyWeight, shard_id: ShardId = None) -> None:
        rows = self.vocab_end_index - self.vocab_start_index
        copy_into(param.data[:rows], loaded_weight.narrow(0, self.vocab_start_index, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids outside this rank's rows look up row 0 and are zeroed; the all-reduce
        # then sums exactly one non-zero embedding per token.
        mine = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local = torch.where(mine, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, rows=[{self.vocab_start_index}, {self.vocab_end_index}), tp_size={self.tp_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same row split, read by LogitsProcessor (never called)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the LM head's weight is applied by LogitsProcessor")
