"""Torch-native attention over the paged KV pool: the CPU path and the reference.

Requests extending by one token (decodes, and the decode part of a MIXED batch)
run as one padded SDPA call per layer (on CPU: the compiled paged kernel, reading
the KV in place); longer extends run one SDPA call each, causal with their cached
prefix in front.

Deterministic mode (`--enable-deterministic-inference`) sends every token, decode or
extend, through the compiled kernel's per-query path instead: a token's attention
is then one fixed-order computation over its own KV rows, identical whether the
token is decoded, prefilled whole, prefilled in chunks after a cached prefix, or
batched with anything (kernels/cpu/paged_attention.cpp). SDPA's flash kernel tiles
queries and keys by the sequence lengths, so its rows are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.attention.base import DecodeAttentionPlan

if TYPE_CHECKING:
    from kernels.attention.base import AttentionBatch
    from kernels.cpu import CpuOps


@dataclass(slots=True)
class _DecodePlan:
    token_idx: torch.Tensor  # [n] positions in the packed token layout
    kv_idx: torch.Tensor  # [n, max_len] KV slots, padded
    mask: torch.Tensor | None  # [n, 1, 1, max_len] True where a slot is attended (None: paged kernel only)
    lens: torch.Tensor  # [n] int64


@dataclass(slots=True)
class _PerQueryPlan:
    """Every token through the kernel's per-query path (deterministic mode)."""

    kv_idx: torch.Tensor  # [bs, max_len] KV slots of each request (only [:lens] read)
    token_req: torch.Tensor  # [T] request of each packed token
    lens: torch.Tensor  # [T] positions token t attends: its prefix and itself


@dataclass(slots=True)
class _ExtendItem:
    start: int  # first packed token
    length: int  # new tokens
    kv_idx: torch.Tensor  # [prefix + length] KV slots
    mask: torch.Tensor | None  # [length, prefix + length]; None = plain causal


class TorchNativeBackend:
    def __init__(self, use_cpu_kernel: bool = False, deterministic: bool = False) -> None:
        # The compiled CPU kernel reads KV in place; the torch path gathers it.
        self._ops: CpuOps | None = None
        if use_cpu_kernel or deterministic:
            from kernels.cpu import load_cpu_ops

            self._ops = load_cpu_ops()
        if deterministic and self._ops is None:
            raise RuntimeError("deterministic inference needs the compiled CPU kernels (a C++ compiler and ninja)")
        self.deterministic = deterministic
        self._per_query: _PerQueryPlan | None = None
        self._all_decode = False
        self._decode: _DecodePlan | None = None
        self._extends: list[_ExtendItem] = []

    def _plan_per_query(self, fb: AttentionBatch) -> None:
        device = fb.input_ids.device
        prefix, ext = fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu
        kv_idx = fb.req_to_token[fb.req_pool_indices, : max(fb.seq_lens_cpu)].to(torch.int64)
        # From a host list: torch.repeat_interleave took ~160 us of a 16-row decode step's ~280.
        token_req = torch.tensor([i for i, n in enumerate(ext) for _ in range(n)], dtype=torch.int64, device=device)
        lens = torch.tensor([p + j + 1 for p, n in zip(prefix, ext) for j in range(n)], dtype=torch.int64, device=device)
        self._per_query = _PerQueryPlan(kv_idx, token_req, lens)

    def init_forward_metadata(self, fb: AttentionBatch) -> None:
        self._per_query, self._decode, self._extends = None, None, []
        self._all_decode = fb.forward_mode.is_decode()
        if self.deterministic:
            self._plan_per_query(fb)
            return
        rows = fb.req_pool_indices
        starts = [0]
        for n in fb.extend_seq_lens_cpu:
            starts.append(starts[-1] + n)
        one = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n == 1]
        many = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n > 1]
        device = fb.input_ids.device

        if one and self._all_decode and self._ops is not None and device.type == "cpu":
            # The paged kernel reads row i's first lens[i] slots only: no mask, no selection.
            kv_idx = fb.req_to_token[rows, : max(fb.seq_lens_cpu)].to(torch.int64)
            self._decode = _DecodePlan(torch.arange(len(one), device=device), kv_idx, None, fb.seq_lens)
        elif one:
            sel = torch.tensor(one, dtype=torch.int64, device=device)
            lens = fb.seq_lens[sel]
            max_len = max(fb.seq_lens_cpu[i] for i in one)
            kv_idx = fb.req_to_token[rows[sel], :max_len].to(torch.int64)
            mask = torch.arange(max_len, device=device)[None, :] < lens[:, None]
            kv_idx = kv_idx.masked_fill(~mask, 0)  # stale slots past seq_len -> the dummy slot
            token_idx = torch.tensor([starts[i] for i in one], dtype=torch.int64, device=device)
            self._decode = _DecodePlan(token_idx, kv_idx, mask[:, None, None, :], lens)

        for i in many:
            prefix, length = fb.extend_prefix_lens_cpu[i], fb.extend_seq_lens_cpu[i]
            kv_idx = fb.req_to_token[rows[i], : prefix + length].to(torch.int64)
            mask = None
            if prefix:
                q_pos = torch.arange(length, device=device)[:, None] + prefix
                mask = torch.arange(prefix + length, device=device)[None, :] <= q_pos
            self._extends.append(_ExtendItem(starts[i], length, kv_idx, mask))

    def decode_attention_plan(self) -> DecodeAttentionPlan | None:
        if self._ops is None or not self._all_decode:
            return None
        if (pq := self._per_query) is not None:  # deterministic: token t is request t's one
            return DecodeAttentionPlan(pq.kv_idx, pq.lens, pq.token_req) if pq.kv_idx.device.type == "cpu" else None
        plan = self._decode
        if plan is None or plan.kv_idx.device.type != "cpu":
            return None
        return DecodeAttentionPlan(plan.kv_idx, plan.lens)

    @staticmethod
    def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
        """`x` rounded to the KV cache's dtype and back: what set_kv wrote, without
        gathering it (a prefill's gathers and casts were ~6 ms of a 128-token prefill)."""
        return x if cache_dtype == dtype else x.to(cache_dtype).to(dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float, fb: AttentionBatch
    ) -> torch.Tensor:
        ops = self._ops if q.device.type == "cpu" else None
        k_buf, v_buf = fb.kv_pool.get_kv(layer_id)
        # The extends' own k, v must enter SDPA as the cache holds them (_as_cached); the
        # kernels' write rounds them so in place (the caller's qkv is dead after attention).
        rounded = ops is not None and bool(self._extends) and k_buf.dtype != k.dtype
        if ops is not None:  # KVPool.set_kv's write, as one pass instead of two index_put calls
            ops.store_kv(k_buf, v_buf, fb.out_cache_loc, k, v, round_src=rounded)
        else:
            fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        pq, plan = self._per_query, self._decode
        if ops is not None and pq is not None:
            return ops.paged_attention(q, k_buf, v_buf, pq.kv_idx, pq.token_req, pq.lens, scaling)
        if ops is not None and plan is not None and self._all_decode:  # each token is its request's one
            return ops.paged_decode(q, k_buf, v_buf, plan.kv_idx, plan.lens, scaling)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]

        for item in self._extends:
            # 4-D inputs: SDPA's CPU flash kernel takes [B, H, L, D]; 3-D ones fall
            # back to the unfused math path (measured 2x slower prefill).
            rows = slice(item.start, item.start + item.length)
            qi = q[rows].transpose(0, 1)[None]  # [1, Hq, L, D]
            if item.kv_idx.numel() == item.length:  # no cached prefix: this call's own k, v,
                # rounded as the cache holds them (the values the gather below reads back)
                ki, vi = (
                    (t[rows] if rounded else self._as_cached(t[rows], k_buf.dtype, q.dtype)).transpose(0, 1)[None]
                    for t in (k, v)
                )
            else:
                ki = k_buf[item.kv_idx].transpose(0, 1).to(q.dtype)[None]  # [1, Hkv, S, D]
                vi = v_buf[item.kv_idx].transpose(0, 1).to(q.dtype)[None]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=item.mask, is_causal=item.mask is None, scale=scaling, enable_gqa=gqa
            )
            out[item.start : item.start + item.length] = oi[0].transpose(0, 1)

        if ops is not None and plan is not None:
            out[plan.token_idx] = ops.paged_decode(q[plan.token_idx], k_buf, v_buf, plan.kv_idx, plan.lens, scaling)
        elif plan is not None:
            qd = q[plan.token_idx][:, :, None, :]  # [n, Hq, 1, D]
            kd = k_buf[plan.kv_idx].transpose(1, 2).to(q.dtype)  # [n, Hkv, S, D]
            vd = v_buf[plan.kv_idx].transpose(1, 2).to(q.dtype)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.mask, scale=scaling, enable_gqa=gqa)
            out[plan.token_idx] = od[:, :, 0, :]
        return out
