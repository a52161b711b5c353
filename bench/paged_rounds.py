"""Teacher forcing over the paged KV pool, run by hand: the model's own forward (extend,
extend over a cached prefix, mixed, decode) without the engine, for quality checks
against a reference (`python -m bench.cpu_mode_quality`, tests/test_models.py and the
quantization tests). Imported lazily by the bench tools, so torch at the top is fine.
"""

from __future__ import annotations

import torch

from kernels.attention.base import AttentionBackend
from kernels.attention.torch_native import TorchNativeBackend
from runtime.distributed.parallel_state import get_tp_size
from runtime.layers.linear import kv_heads_per_rank
from runtime.mem.kv_pool import KVPool
from runtime.model_config import ModelConfig
from runtime.model_executor.forward_batch import ForwardBatch, ForwardMode


class PagedRequests:
    """A hand-run request pool laid out as the scheduler lays requests out: one
    req_to_token row per request, request r's position p in page `page_of[r, p //
    page_size]` (pages 1, 2, ... in order, or shuffled by `seed`; page 0 holds the pool's
    dummy slot). The KV pool holds this tensor-parallel rank's kv heads in the config's KV
    dtype, on `device`; `backend` (default: the torch one) plans each batch."""

    def __init__(
        self,
        config: ModelConfig,
        num_requests: int,
        max_tokens: int = 128,
        *,
        page_size: int = 1,
        backend: AttentionBackend | None = None,
        device: torch.device | str = "cpu",
        seed: int | None = None,
    ) -> None:
        self.page_size, self.device = page_size, torch.device(device)
        self.backend: AttentionBackend = backend if backend is not None else TorchNativeBackend()
        pages_per_req = -(-max_tokens // page_size)
        num_pages = num_requests * pages_per_req
        order = torch.arange(num_pages) if seed is None else torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
        self.page_of = (order + 1).view(num_requests, pages_per_req)
        kv_heads = kv_heads_per_rank(config.num_kv_heads, get_tp_size())
        self.pool = KVPool((num_pages + 1) * page_size, config.num_layers, kv_heads, config.head_dim, config.kv_dtype, device)
        self.req_to_token = torch.zeros(num_requests, max_tokens, dtype=torch.int32, device=device)
        self.lens = [0] * num_requests

    def slot(self, row: int, pos: int) -> int:
        return int(self.page_of[row, pos // self.page_size]) * self.page_size + pos % self.page_size

    def batch(self, new_tokens: dict[int, list[int]], plan: bool = True) -> ForwardBatch:
        """The forward of `new_tokens[r]` more tokens of each request r; planned by the
        backend unless `plan` is False (a CUDA graph replay plans its own)."""
        rows = [r for r, toks in new_tokens.items() if toks]
        ids, positions, locs, prefix, extend = [], [], [], [], []
        for r in rows:
            n, start = len(new_tokens[r]), self.lens[r]
            slots = [self.slot(r, p) for p in range(start, start + n)]
            self.req_to_token[r, start : start + n] = torch.tensor(slots, dtype=torch.int32, device=self.device)
            ids += new_tokens[r]
            positions += range(start, start + n)
            locs += slots
            prefix.append(start)
            extend.append(n)
            self.lens[r] += n
        seq = [p + e for p, e in zip(prefix, extend)]
        if all(e == 1 for e in extend):
            mode = ForwardMode.DECODE
        else:
            mode = ForwardMode.MIXED if any(e == 1 for e in extend) else ForwardMode.EXTEND
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=as_t(ids),
            positions=as_t(positions),
            out_cache_loc=as_t(locs),
            req_pool_indices=as_t(rows),
            seq_lens=as_t(seq),
            extend_prefix_lens=as_t(prefix),
            extend_seq_lens=as_t(extend),
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=extend,
            req_to_token=self.req_to_token,
            kv_pool=self.pool,
            attn_backend=self.backend,
        )
        if plan:
            self.backend.init_forward_metadata(fb)
        return fb


@torch.no_grad()
def run_in_rounds(
    model: torch.nn.Module, config: ModelConfig, seqs: list[list[int]], rounds: list[list[int]]
) -> list[torch.Tensor]:
    """Feed `rounds[k][i]` more tokens of `seqs[i]` in round k; logits [len, vocab] per sequence."""
    reqs = PagedRequests(config, len(seqs))
    fed = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for sizes in rounds:
        chunk = {i: seqs[i][fed[i] : fed[i] + n] for i, n in enumerate(sizes) if n}
        fb = reqs.batch(chunk)
        logits = model.compute_logits(model(fb.input_ids, fb.positions, fb))
        assert logits.dtype == torch.float32
        for i, piece in zip(chunk, logits.split(fb.extend_seq_lens_cpu)):
            out[i].append(piece)
            fed[i] += len(chunk[i])
    assert fed == [len(s) for s in seqs], "rounds must cover every token"
    return [torch.cat(parts) for parts in out]


def teacher_forced(model: torch.nn.Module, config: ModelConfig, windows: list[list[int]], decode_steps: int = 16) -> torch.Tensor:
    """Logits `[sum of lens, vocab]` of each window fed as one prefill of all but its last
    `decode_steps` tokens, then those one decode step at a time: both paths of a mode."""
    rounds = lambda w: [[len(w) - decode_steps]] + [[1]] * decode_steps  # noqa: E731
    return torch.cat([run_in_rounds(model, config, [w], rounds(w))[0] for w in windows])
