"""A bfloat16 KV cache under the float32 model (`kv_cache_dtype`): half the KV
bytes, and outputs HF transformers still considers greedy."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import load_paged_decode
from tests.conftest import assert_all_memory_free

MAX_NEW = 16
# bf16 keeps 8 mantissa bits: each cached K/V element is off by up to 0.4%, which
# moves next-token logprobs by a few hundredths. A token within this many nats
# of HF's best is a near-tie that the narrower cache may flip.
KV_BF16_LOGPROB_TOL = 0.1


def _reference_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, idx: torch.Tensor, lens: list[int]) -> torch.Tensor:
    out = []
    for i, n in enumerate(lens):
        k = k_buf[idx[i, :n]].float().transpose(0, 1)[None]  # [1, Hkv, n, D]
        v = v_buf[idx[i, :n]].float().transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q[i][None, :, None, :].to(k.dtype), k, v, enable_gqa=True)
        out.append(o[0, :, 0, :])
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_paged_decode_kernel_matches_sdpa(kv_dtype: torch.dtype) -> None:
    kernel = load_paged_decode()
    assert kernel is not None, "the CPU kernel must build where g++ and ninja exist"
    gen = torch.Generator().manual_seed(0)
    slots, hkv, hq, d = 500, 3, 9, 64
    k_buf = torch.randn(slots, hkv, d, generator=gen).to(kv_dtype)
    v_buf = torch.randn(slots, hkv, d, generator=gen).to(kv_dtype)
    lens = [1, 37, 200, 5]
    idx = torch.stack([torch.randperm(slots, generator=gen)[:200] for _ in lens])  # scattered slots
    q = torch.randn(len(lens), hq, d, generator=gen)
    ours = kernel(q, k_buf, v_buf, idx, torch.tensor(lens), d**-0.5)
    torch.testing.assert_close(ours, _reference_decode(q, k_buf, v_buf, idx, lens), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32)])
def test_cpu_paged_decode_takes_a_cache_of_another_dtype_than_a_16_bit_q(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    kernel = load_paged_decode()
    assert kernel is not None
    gen = torch.Generator().manual_seed(2)
    k_buf, v_buf = (torch.randn(300, 3, 64, generator=gen).to(kv_dtype) for _ in range(2))
    idx = torch.randperm(300, generator=gen)[:90].view(2, 45)
    q = torch.randn(2, 9, 64, generator=gen).to(q_dtype)
    ours = kernel(q, k_buf, v_buf, idx, torch.tensor([45, 20]), 0.125)
    assert ours.dtype == q_dtype  # computed in float32 over the cache as it is, rounded once
    ref = _reference_decode(q.float(), k_buf, v_buf, idx, [45, 20])
    torch.testing.assert_close(ours, ref.to(q_dtype), atol=1e-2, rtol=1e-2)


# One long sequence (its positions split into spans over the threads, then merged), a
# short one (too short to split), other head layouts (MHA; 4 q heads per kv head at D 32
# and at D 64, which has its own compiled span kernel as SmolLM2's 3 at 64 has; D 128, 48),
# and a float64 q (the plain loop).
@pytest.mark.parametrize(
    ("lens", "hq", "hkv", "d", "dtype"),
    [([300], 9, 3, 64, torch.float32), ([7], 9, 3, 64, torch.float32), ([64, 1], 8, 8, 128, torch.float32),
     ([1000], 4, 1, 32, torch.float32), ([40, 130], 8, 2, 64, torch.float32), ([33, 90, 2], 6, 2, 48, torch.float32),
     ([150], 9, 3, 64, torch.float64)],
)  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_paged_decode_splits_a_long_sequence_and_handles_every_head_layout(
    lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, threads: int
) -> None:
    kernel = load_paged_decode()
    assert kernel is not None
    gen = torch.Generator().manual_seed(1)
    slots = 2000
    k_buf = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    v_buf = torch.randn(slots, hkv, d, generator=gen).to(dtype)
    idx = torch.stack([torch.randperm(slots, generator=gen)[: max(lens)] for _ in lens])
    q = torch.randn(len(lens), hq, d, generator=gen).to(dtype) * 3  # peaked softmax: the merge's rescaling matters
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = kernel(q, k_buf, v_buf, idx, torch.tensor(lens), d**-0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(ours, _reference_decode(q, k_buf, v_buf, idx, lens).to(dtype), atol=1e-5, rtol=1e-4)


def test_bf16_kv_cache_generates_what_hf_considers_greedy(make_engine: Any, prompts: list[list[int]], hf_oracle: Any) -> None:
    engine = make_engine(kv_cache_dtype="bfloat16", page_size=4)
    assert engine.worker.kv_pool.k_buffer[0].dtype == torch.bfloat16
    outs = engine.generate(prompts, {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
    worst = 0.0
    for prompt, out in zip(prompts, outs):
        ids = out["output_ids"]
        assert len(ids) == MAX_NEW
        lp = hf_oracle.logprobs_along(prompt, ids)
        worst = max(worst, float((lp.max(dim=-1).values - lp[torch.arange(MAX_NEW), ids]).max()))
    assert worst < KV_BF16_LOGPROB_TOL, f"a token {worst:.3f} nats below HF's greedy choice"
    assert_all_memory_free(engine)

