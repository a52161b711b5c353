"""The pieces `--enable-deterministic-inference` is built from, each checked for the one
property it promises: a row's result does not depend on the other rows of its batch
(how many, which, where it sits). No model weights: random tensors, the compiled CPU
kernels (skipped where they cannot be built) and torch's own kernels."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu import CpuOps
from runtime.layers.batch_invariant import BLOCK_ROWS, batch_invariant_linear
from runtime.layers.quantization.int4 import pack_int4, quantize_int4_values
from runtime.layers.quantization.int8 import quantize_int8
from runtime.layers.quantization.q8 import pack_q8_exact, q8_blocks
from runtime.layers.rotary_embedding import RotaryEmbedding, apply_rotary

# SmolLM2-135M's linear shapes (in, out): qkv, gate|up, down, LM head.
SHAPES = [(576, 960), (576, 3072), (1536, 576), (576, 49152)]
BATCH_SIZES = [1, 2, 3, 7, 16, 17, 33, 64, 100]


def rows_alone_equal_rows_in_batches(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Every prefix batch x[:m] gives, for each of its rows, the bits that row gets alone."""
    alone = torch.cat([matmul(x[i : i + 1]) for i in range(x.shape[0])])
    return all(torch.equal(matmul(x[:m]), alone[:m]) for m in BATCH_SIZES if m <= x.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_fixed_row_blocks_make_a_float_linear_batch_invariant(k: int, n: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w, x = (torch.randn(n, k) * 0.05).to(dtype), torch.randn(100, k).to(dtype)
    assert rows_alone_equal_rows_in_batches(lambda rows: batch_invariant_linear(rows, w), x)
    # ...and it is F.linear's arithmetic: a full block is one plain call.
    assert torch.equal(batch_invariant_linear(x[:BLOCK_ROWS], w), F.linear(x[:BLOCK_ROWS], w))


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_torchs_int4_and_int8_weight_kernels_are_row_invariant_as_declared(k: int, n: int) -> None:
    """Int4LinearMethod and Int8LinearMethod declare row_invariant = True: no row blocks."""
    torch.manual_seed(0)
    w, x = torch.randn(n, k) * 0.05, torch.randn(100, k).bfloat16()
    q, scales_and_zeros = quantize_int4_values(w, 32)
    packed = pack_int4(q)
    assert rows_alone_equal_rows_in_batches(lambda r: torch._weight_int4pack_mm_for_cpu(r, packed, 32, scales_and_zeros), x)
    qweight, scales = quantize_int8(w)
    assert rows_alone_equal_rows_in_batches(lambda r: torch._weight_int8pack_mm(r, qweight, scales), x)


def test_q8_lm_head_is_exact_for_q8_weights_and_batch_invariant(cpu_ops: CpuOps) -> None:
    torch.manual_seed(0)
    n, k = 4096, 576
    d = (torch.rand(n, k // 32) * 0.01).half().float()  # a GGUF Q8_0 scale is a float16
    q = torch.randint(-127, 128, (n, k // 32, 32)).float()
    q[..., 0] = 127  # llama.cpp's rounding puts each block's largest |value| at 127
    w = (q * d[..., None]).view(n, k)
    packed = pack_q8_exact(w)
    assert packed is not None, "Q8_0 weights dequantized to float32 must pack exactly"
    x = torch.randn(40, k)
    y = cpu_ops.q8_linear(x, packed.qw, packed.scales)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert rows_alone_equal_rows_in_batches(lambda r: cpu_ops.q8_linear(r, packed.qw, packed.scales), x)


def test_q8_packing_refuses_weights_it_would_change() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 576)
    assert pack_q8_exact(w) is None  # arbitrary floats: not Q8 blocks
    assert pack_q8_exact(w.bfloat16()) is None
    q, d = q8_blocks(w)
    assert (q.abs() <= 127).all() and d.shape == (64, 18)


def test_paged_attention_gives_a_token_the_same_bits_however_its_prompt_is_split(cpu_ops: CpuOps) -> None:
    """Whole prefill, chunks after a cached prefix, batched with another request, or
    as a decode step (one query alone): one query's output is one fixed computation."""
    torch.manual_seed(0)
    hq, hkv, d, length = 9, 3, 64, 50
    k_buf, v_buf = torch.randn(400, hkv, d), torch.randn(400, hkv, d)
    slots = torch.randperm(399)[: 2 * length] + 1
    kv_idx = torch.stack([slots[:length], slots[length:]])  # two requests' slots
    q = torch.randn(length, hq, d)

    def attend(rows: torch.Tensor, req: int, first: int) -> torch.Tensor:
        n = rows.shape[0]
        return cpu_ops.paged_attention(rows, k_buf, v_buf, kv_idx, torch.full((n,), req), torch.arange(first, first + n) + 1, 0.125)

    whole = attend(q, 0, 0)
    chunks = torch.cat([attend(q[:17], 0, 0), attend(q[17:40], 0, 17), attend(q[40:], 0, 40)])
    assert torch.equal(chunks, whole)
    other = torch.randn(30, hq, d)
    batched = cpu_ops.paged_attention(
        torch.cat([other, q]), k_buf, v_buf, kv_idx,
        torch.cat([torch.ones(30, dtype=torch.long), torch.zeros(length, dtype=torch.long)]),
        torch.cat([torch.arange(30) + 1, torch.arange(length) + 1]), 0.125,
    )  # fmt: skip
    assert torch.equal(batched[30:], whole)
    decode_step = cpu_ops.paged_attention(q[-1:], k_buf, v_buf, kv_idx, torch.zeros(1, dtype=torch.long), torch.tensor([length]), 0.125)
    assert torch.equal(decode_step[0], whole[-1])
    # The fast decode kernel (the default path) is the same attention, summed in another order.
    fast = cpu_ops.paged_decode(q[-1:], k_buf, v_buf, kv_idx[:1], torch.tensor([length]), 0.125)
    torch.testing.assert_close(fast[0], whole[-1], rtol=1e-5, atol=1e-5)
    # and it is attention: causal SDPA over the same keys.
    keys, values = k_buf[kv_idx[0]].transpose(0, 1)[None], v_buf[kv_idx[0]].transpose(0, 1)[None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, is_causal=True, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(whole, ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("group", "head_dim"), [(3, 64), (4, 64), (1, 16), (2, 32), (4, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_attention_path_gives_a_token_one_result(
    cpu_ops: CpuOps, kv_dtype: torch.dtype, group: int, head_dim: int, threads: int
) -> None:
    """paged_attention's paths (a prefill's shared K tiles, a short extend's own tiles, a
    lone decode split by kv head, a batch's decode reading K/V rows in place) and the
    default paged_decode, where it neither splits a sequence nor runs out of registers,
    are one arithmetic
    (kernels/cpu/attention_span.h): a token gets the same bits from each, with any
    number of threads, for every KV dtype and head shape."""
    torch.manual_seed(0)
    hkv, length, others = 2, 70, 5
    hq = hkv * group
    k_buf = torch.randn(900, hkv, head_dim).to(kv_dtype)
    v_buf = torch.randn(900, hkv, head_dim).to(kv_dtype)
    kv_idx = (torch.randperm(899)[: (1 + others) * length] + 1).view(1 + others, length)
    q = torch.randn(length, hq, head_dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def attend(rows: torch.Tensor, reqs: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
            return cpu_ops.paged_attention(rows, k_buf, v_buf, kv_idx, reqs, lens, 0.125)

        def extend(first: int, last: int) -> torch.Tensor:  # request 0's tokens first..last-1
            return attend(q[first:last], torch.zeros(last - first, dtype=torch.long), torch.arange(first, last) + 1)

        whole = extend(0, length)  # blocks of 8 queries (kQueries): shared tiles
        assert torch.equal(torch.cat([extend(0, 40), extend(40, 46), extend(46, length)]), whole)  # 6: one block, own tiles
        for t in (0, 15, 16, 37, length - 1):  # lone decodes
            assert torch.equal(extend(t, t + 1), whole[t : t + 1]), t
        # A decode batch: request 0's last token among other requests' tokens of other lengths.
        lens = torch.tensor([length, 3, 17, 33, 64, 70])
        batch = torch.cat([q[-1:], torch.randn(others, hq, head_dim)])
        decoded = attend(batch, torch.arange(1 + others), lens)
        assert torch.equal(decoded[0], whole[-1])
        # paged_decode splits a sequence only to feed idle threads, and runs attend_span
        # where the G x D / 16 sums fit its registers (else a plain loop).
        if threads == 1 and group * head_dim // 16 <= 16:
            fast = cpu_ops.paged_decode(batch, k_buf, v_buf, kv_idx, lens, 0.125)
            assert torch.equal(fast, decoded)
    finally:
        torch.set_num_threads(before)
    # and it is attention: causal SDPA over the same keys.
    keys, values = (buf[kv_idx[0]].float().transpose(0, 1)[None] for buf in (k_buf, v_buf))
    ref = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, is_causal=True, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(whole, ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_rounds_as_torch_does(cpu_ops: CpuOps, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 1001) * 100  # not a multiple of the vector width
    x[0, :6] = torch.tensor([1.00390625, 1.01171875, 1.0 + 2**-11, float("inf"), -0.0, 1e-40])  # ties, specials, subnormal
    narrow = cpu_ops.cast(x, dtype)
    assert narrow.dtype == dtype and torch.equal(narrow, x.to(dtype))
    assert torch.equal(cpu_ops.cast(narrow, torch.float32), narrow.float())
    assert cpu_ops.cast(x, torch.float32) is x  # already that dtype: no copy


@pytest.mark.parametrize("shape", [(1, 49152), (16, 49152), (3, 7), (2, 33), (1, 1)])
def test_argmax_rows_answers_what_torch_argmax_answers(cpu_ops: CpuOps, shape: tuple[int, int]) -> None:
    """The greedy sampler's argmax: the first maximum of each row, ties and NaN as torch."""
    torch.manual_seed(0)
    for trial in range(12):
        x = torch.randn(*shape)
        if trial % 3 == 1:
            x = x.round()  # many ties for the maximum
        if trial % 4 == 2:
            x[0, torch.randint(shape[1], (1,))] = float("nan")
        if trial % 4 == 3:
            x[-1, -1] = x[-1].max()  # the maximum again at the very end
        assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1)), (shape, trial)
    assert torch.equal(cpu_ops.argmax_rows(torch.ones(2, 40)), torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_row_ops_match_the_torch_code_they_replace(cpu_ops: CpuOps, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, residual, w = torch.randn(7, 576).to(dtype), torch.randn(7, 576).to(dtype), torch.randn(576).to(dtype)
    total = x + residual
    res = residual.clone()
    out = cpu_ops.add_rms_norm_(x, res, w, 1e-5)
    assert torch.equal(res, total), "the residual stream is updated in place, rounded as torch rounds x + residual"
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, w * F.rms_norm(total.float(), (576,), eps=1e-5).to(dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), w * F.rms_norm(x.float(), (576,), eps=1e-5).to(dtype), rtol=tol, atol=tol)

    gate_up = torch.randn(5, 3072).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_mul(gate_up), F.silu(gate) * up, rtol=tol, atol=tol)

    rope = RotaryEmbedding(64, 4096, {"rope_theta": 100000.0, "rope_type": "default"})
    positions = torch.tensor([0, 5, 77, 4000, 3])
    qkv = torch.randn(5, 960).to(dtype)
    inputs = rope(positions)
    rotated = qkv.clone()
    cpu_ops.rotary_(rotated, positions, inputs.cos_sin_cache, 12, 64)  # 9 q heads + 3 k heads
    q, k = qkv[:, :576].view(5, 9, 64), qkv[:, 576:768].view(5, 3, 64)
    torch.testing.assert_close(rotated[:, :576].view(5, 9, 64), apply_rotary(q, inputs.cos, inputs.sin), rtol=tol, atol=tol)
    torch.testing.assert_close(rotated[:, 576:768].view(5, 3, 64), apply_rotary(k, inputs.cos, inputs.sin), rtol=tol, atol=tol)
    assert torch.equal(rotated[:, 768:], qkv[:, 768:]), "v is not rotated"


def test_the_samplers_row_reductions_are_batch_invariant() -> None:
    """What the sampler computes per row at temperature 0 (argmax, log_softmax for
    logprobs, topk for top logprobs) and with a per-request seed (softmax, the seeded
    exponential race) gives a row the same result alone or in a batch."""
    from kernels.sampling import sample_no_sync

    torch.manual_seed(0)
    logits = torch.randn(33, 49152) * 4
    for m in (1, 2, 7, 33):
        assert torch.equal(logits[:m].argmax(-1), logits.argmax(-1)[:m])
        assert torch.equal(torch.log_softmax(logits[:m], -1), torch.log_softmax(logits, -1)[:m])
        assert torch.equal(torch.log_softmax(logits[:m], -1).topk(5, -1).values, torch.log_softmax(logits, -1).topk(5, -1).values[:m])
        assert torch.equal(torch.softmax(logits[:m] / 0.7, -1), torch.softmax(logits / 0.7, -1)[:m])
    probs = torch.softmax(logits, -1)
    seeded = lambda rows: sample_no_sync(probs[rows], [torch.Generator().manual_seed(100 + r) for r in rows])  # noqa: E731
    alone = torch.cat([seeded([r]) for r in range(33)])
    assert torch.equal(seeded(list(range(33))), alone)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("round_src", [False, True])
def test_store_kv_writes_what_the_pools_index_put_writes(cpu_ops: CpuOps, kv_dtype: torch.dtype, round_src: bool) -> None:
    torch.manual_seed(0)
    qkv = torch.randn(5, 960)
    # Values every cast must round as torch does: float16 subnormals, past its range,
    # halfway between two float16 values (ties to even), signed zeros.
    qkv[0, 576:600] = torch.tensor([1e-5, -3e-7, 6e-8, 7e4, -1e5, 65520.0, 65519.0, 1 + 2**-11, 1 + 3 * 2**-11, -0.0, 0.0, 2**-25,
                                     3e38, -2**-14, 2**-24 * 1.5, 1e-3, 2049.0, 2051.0, 4097.0, -1e-8, 0.1, -0.3, 1 / 3, 1e-4])
    before = qkv.clone()
    k, v = qkv[:, 576:768].view(5, 3, 64), qkv[:, 768:].view(5, 3, 64)  # strided views, as the model passes them
    k_in, v_in = k.clone(), v.clone()
    loc = torch.tensor([7, 2, 40, 11, 3])
    k_buf, v_buf = torch.zeros(50, 3, 64, dtype=kv_dtype), torch.zeros(50, 3, 64, dtype=kv_dtype)
    cpu_ops.store_kv(k_buf, v_buf, loc, k, v, round_src=round_src)
    k_ref, v_ref = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    k_ref[loc], v_ref[loc] = k_in.to(kv_dtype), v_in.to(kv_dtype)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    # round_src: k and v now hold what the cache holds (the values prefill attention
    # reads), and nothing else of qkv changed; without it they are left alone.
    if round_src:
        assert torch.equal(k, k_ref[loc].float()) and torch.equal(v, v_ref[loc].float())
        assert torch.equal(qkv[:, :576], before[:, :576])
    else:
        assert torch.equal(qkv, before)
    assert round_src == (not torch.equal(qkv, before)) or kv_dtype == torch.float32


def test_prompt_rows_follow_token_roles_and_reach_every_rank() -> None:
    """Under deterministic inference a row's linear kernel follows its token's role: given
    text takes the tiles (PromptRows.dense), answers the Q4 blocks - the generated tokens
    past the prompt and an earlier answer inside it (runtime/token_roles.py) - and every
    tensor-parallel rank gets the roles to split its shard's rows the same way."""
    from runtime.layers.batch_invariant import PromptRows
    from runtime.model_executor import tp_channel
    from runtime.model_executor.forward_batch import ForwardMode
    from runtime.model_executor.worker import ForwardInputs
    from runtime.token_roles import role_switches

    # A whole prompt and a chunk after a cached prefix: every row given text.
    assert PromptRows.of([0, 16], [5, 4], [(5,), (30,)]) == PromptRows(None, None)
    # Decodes and a retracted request's recomputed outputs only: none.
    assert PromptRows.of([7, 9], [1, 6], [(7,), (9,)]) is None
    # A prompt's last 2 tokens and its 3 outputs, then a decode, then a prompt chunk.
    rows = PromptRows.of([3, 12, 0], [5, 1, 2], [(5,), (8,), (4,)])
    assert rows is not None and rows.dense is not None and rows.rest is not None
    assert rows.dense.tolist() == [0, 1, 6, 7] and rows.rest.tolist() == [2, 3, 4, 5]
    # The rows an extend's last layer keeps (each request's last token) keep their roles.
    last = rows.select(torch.tensor([4, 5, 7]))
    assert last is not None and last.dense is not None and last.rest is not None
    assert last.dense.tolist() == [2] and last.rest.tolist() == [0, 1]
    assert rows.select(torch.tensor([0, 6])) == PromptRows(None, None) and rows.select(torch.tensor([3, 5])) is None
    # A chat prompt of 12 whose tokens 2-4 and 7-8 are earlier answers, from position 1,
    # then its first output; and a span ending where the prompt does.
    chat = role_switches(12, [(2, 5), (7, 9)])
    assert chat == (2, 5, 7, 9, 12)
    rows = PromptRows.of([1, 0], [12, 4], [chat, role_switches(3, [(1, 3)])])
    assert rows is not None and rows.dense is not None and rows.rest is not None
    assert rows.dense.tolist() == [0, 4, 5, 8, 9, 10, 12] and rows.rest.tolist() == [1, 2, 3, 6, 7, 11, 13, 14, 15]

    inputs = ForwardInputs(
        forward_mode=ForwardMode.MIXED, input_ids=torch.arange(8), out_cache_loc=torch.arange(1, 9),
        req_pool_indices=[0, 1, 2], seq_lens=[8, 13, 2], extend_prefix_lens=[3, 12, 0], extend_seq_lens=[5, 1, 2],
        prefix_slots=[torch.tensor([4, 5, 6]), None, torch.empty(0, dtype=torch.int64)], row_syncs=[],
        role_switches=[(5,), chat, (1, 3, 4)], prompt_logprob_rows=[2, 6],
    )  # fmt: skip
    got = tp_channel.decode(*tp_channel.encode(inputs, inputs.input_ids))
    assert got.role_switches == [(5,), chat, (1, 3, 4)] and got.prompt_logprob_rows == [2, 6]
