"""The interface every attention backend implements, and what it reads.

Kernels sit at the bottom of the import graph: they see a batch and the KV pool
only through the two protocols below, which runtime's `ForwardBatch` and `KVPool`
satisfy structurally.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class KVCache(Protocol):
    """Per-layer K and V tensors `[slots, num_kv_heads, head_dim]`, indexed by KV slot."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    k_buffer: list[torch.Tensor]
    v_buffer: list[torch.Tensor]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class Mode(Protocol):
    def is_decode(self) -> bool: ...


class AttentionBatch(Protocol):
    """What a backend reads of one forward (runtime's ForwardBatch)."""

    @property
    def forward_mode(self) -> Mode: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def out_cache_loc(self) -> torch.Tensor: ...
    @property
    def req_pool_indices(self) -> torch.Tensor: ...
    @property
    def seq_lens(self) -> torch.Tensor: ...
    @property
    def seq_lens_cpu(self) -> list[int]: ...
    @property
    def extend_prefix_lens_cpu(self) -> list[int]: ...
    @property
    def extend_seq_lens_cpu(self) -> list[int]: ...
    @property
    def req_to_token(self) -> torch.Tensor: ...
    @property
    def kv_pool(self) -> KVCache: ...
    @property
    def attn_backend(self) -> AttentionBackend: ...


class DecodeAttentionPlan(NamedTuple):
    """An all-decode batch's attention on the CPU kernels: `paged_decode(q, pool, kv_idx,
    lens)`, or with `token_req` the per-query `paged_attention(q, pool, kv_idx, token_req,
    lens)` that deterministic inference uses for every token."""

    kv_idx: torch.Tensor  # [n, max_len] int64; row i's first lens[i] slots are read
    lens: torch.Tensor  # [n] int64
    token_req: torch.Tensor | None = None  # [n]: query t reads kv_idx row token_req[t]


class AttentionBackend(Protocol):
    def init_forward_metadata(self, fb: AttentionBatch) -> None:
        """Plan once per batch; `forward` reuses the plan for every layer."""

    def decode_attention_plan(self) -> DecodeAttentionPlan | None:
        """Where this batch's attention is, for every layer, one CPU kernel call over the
        plan (an all-decode batch); else None. A caller that runs the layers itself
        (kernels/cpu/decode_stack.cpp) needs it."""
        ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float, fb: AttentionBatch
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the batch's new tokens.

        Writes k, v into the KV pool at `fb.out_cache_loc`, then attends each new
        token to its request's prefix and to the new tokens at or before it.
        Returns [T, Hq, D].
        """
        ...
