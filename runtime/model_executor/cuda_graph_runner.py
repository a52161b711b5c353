"""CudaGraphRunner: decode forwards replayed from CUDA graphs, one per batch-size bucket.

A decode step of a small batch is launch-bound: ~10 kernels per layer, each a few
microseconds of GPU work. Capturing the model's forward once per bucket turns the
whole step into one graph launch; the lm_head then runs eagerly on the real rows
(one matmul, and no `[bucket, vocab]` output held per graph).

Static inputs (input_ids, positions, out_cache_loc) are sized to the largest
bucket; a batch of `bs` is copied into rows [:bs] and padded to the next bucket.
A padding row is a one-token request on the dummy page: input id 0, position 0,
and it writes its K/V to slot 0, which the allocator never hands out, so padding
never touches a live request's KV. Attention metadata is re-planned outside the
graph before each replay (FlashInfer wrappers in CUDA-graph mode plan into fixed
buffers the graph reads).

Graphs are captured on `stream`, the stream the worker runs forwards on, and
share one memory pool: the largest bucket is captured first and the smaller ones
reuse its memory, so one graph's output may alias another's scratch. That is safe
because replays are stream-ordered and a replay's output is consumed (lm_head)
before the next replay is enqueued.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import torch

from runtime.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from runtime.mem.kv_pool import KVPool

WARMUP_RUNS = 2  # eager runs before capture: FlashInfer JIT, cuBLAS workspaces, allocator


def cuda_graph_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's capture list cut at `max_bs`, with `max_bs` itself always included
    (so every decode batch up to max_bs has a bucket)."""
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    sizes = [b for b in sizes if b <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def pick_bucket(buckets: list[int], bs: int) -> int:
    """Smallest captured size >= bs. `buckets` is sorted; bs <= buckets[-1]."""
    i = bisect.bisect_left(buckets, bs)
    if bs < 1 or i == len(buckets):
        raise ValueError(f"no CUDA-graph bucket for batch size {bs} (largest is {buckets[-1]})")
    return buckets[i]


def padding_waste(buckets: list[int]) -> float:
    """Worst-case share of a replayed batch that is padding (a capture-list sanity metric)."""
    worst, prev = 0.0, 0
    for b in buckets:
        worst = max(worst, (b - (prev + 1)) / b)
        prev = b
    return worst


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn_backend: Any,  # FlashInferBackend (the CUDA-graph hooks are FlashInfer's)
        kv_pool: KVPool,
        req_to_token: torch.Tensor,
        max_bs: int,
        stream: torch.cuda.Stream | None = None,
        use_graphs: bool = True,
    ) -> None:
        """`use_graphs=False` keeps the static buffers, padding and re-planning but
        runs the forward eagerly: the same path minus capture, for debugging and for
        testing the padding logic without a GPU."""
        self.device = req_to_token.device
        if use_graphs and (self.device.type != "cuda" or not torch.cuda.is_available()):
            raise RuntimeError(f"CUDA graphs need a CUDA device (got {self.device}); pass disable_cuda_graph")
        self.model = model
        self.backend = attn_backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.buckets = cuda_graph_batch_sizes(max_bs)
        self.max_bs = self.buckets[-1]
        self.use_graphs = use_graphs
        self.stream = stream
        dev = self.device
        # Rows [bs:bucket] of these are padding; out_cache_loc's must be 0 at every replay.
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's output, [bucket, hidden]
        self.static_batches: dict[int, ForwardBatch] = {}
        self.pool: Any = None
        attn_backend.init_cuda_graph_state(self.max_bs, -(-req_to_token.shape[1] // attn_backend.page_size))

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and fb.batch_size <= self.max_bs and bool(self.static_batches)

    def _static_batch(self, bs: int) -> ForwardBatch:
        ones = self.seq_lens[:bs]
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=ones,
            extend_prefix_lens=ones - 1,
            extend_seq_lens=ones,
            seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[0] * bs,
            extend_seq_lens_cpu=[1] * bs,
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
        )

    def _run(self, fb: ForwardBatch) -> torch.Tensor:
        # Hidden states only: the graph's output stays [bucket, hidden], not
        # [bucket, vocab] per bucket, and padding rows never reach the lm_head.
        return self.model(fb.input_ids, fb.positions, fb)

    # ---- capture -------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller graphs reuse its pool)."""
        stream = (self.stream or torch.cuda.Stream(self.device)) if self.use_graphs else None
        if stream is not None:  # the static buffers, pools and weights were made on the default stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
        for bs in reversed(self.buckets):
            fb = self._static_batch(bs)
            self.static_batches[bs] = fb
            if stream is None:
                self.backend.init_forward_metadata_capture_cuda_graph(bs, fb)
                continue
            # Plan, warm up and capture on one stream: the graph reads what the plan wrote.
            with torch.cuda.stream(stream):
                self.backend.init_forward_metadata_capture_cuda_graph(bs, fb)
                for _ in range(WARMUP_RUNS):
                    self._run(fb)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.hidden[bs] = self._run(fb)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph

    # ---- replay --------------------------------------------------------------------------
    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits `[bs, vocab]` float32 of decode batch `fb`. Call it on the stream the
        graphs were captured for; the lm_head runs eagerly on the real rows only."""
        bs = fb.batch_size
        bucket = pick_bucket(self.buckets, bs)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        if bucket > bs:
            # A larger batch may have left live slots in the padding rows; stale ids and
            # positions are harmless (valid values, outputs dropped), stale slots are not.
            self.out_cache_loc[bs:bucket].zero_()
        self.backend.init_forward_metadata_replay_cuda_graph(bucket, fb)
        if self.use_graphs:
            self.graphs[bucket].replay()
            hidden = self.hidden[bucket]
        else:
            hidden = self._run(self.static_batches[bucket])
        return self.model.compute_logits(hidden[:bs])


__all__ = ["CudaGraphRunner", "cuda_graph_batch_sizes", "pick_bucket", "padding_waste"]
