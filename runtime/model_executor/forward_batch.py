"""ForwardMode and ForwardBatch: what one model forward sees.

Token layout is packed: the batch's new tokens are concatenated request by request,
`extend_seq_lens[i]` of them for request i. A decode step is the special case where
every request extends by one token, so attention backends see one ragged layout
(with a paged KV prefix of `extend_prefix_lens[i]` tokens) in every mode.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.attention.base import AttentionBackend
    from runtime.layers.batch_invariant import PromptRows
    from runtime.mem.kv_pool import KVPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill, possibly continuing a cached prefix or a chunk
    DECODE = 2  # one new token per request
    MIXED = 3  # prefill chunk(s) plus running decodes (extend length 1)
    IDLE = 4  # nothing to compute this round

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass(slots=True)
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64, placeholders already resolved
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot written for each new token
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64, total length after this forward
    extend_prefix_lens: torch.Tensor  # [bs] int64, tokens already in the KV pool
    extend_seq_lens: torch.Tensor  # [bs] int64, new tokens this forward
    # Host copies of the lengths: backends loop or plan over them without a sync.
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    req_to_token: torch.Tensor  # [rows, context_len] int32 (the worker's copy)
    kv_pool: KVPool
    attn_backend: AttentionBackend
    # Prompt logprobs: packed token indices to score, and (set by the forward) their final hidden states.
    prompt_logprob_rows: torch.Tensor | None = None
    prompt_hidden: torch.Tensor | None = None
    # Deterministic inference: which rows are prompt tokens (their linears' kernel).
    prompt_rows: PromptRows | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
