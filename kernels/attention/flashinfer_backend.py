"""FlashInfer attention over the paged KV pool: the CUDA path.

Layout. KVPool rows are KV slots, `slot = page * page_size + offset`, so each
layer's `[rows, H, D]` buffer is viewed, without a copy, as FlashInfer's NHD paged
cache `[rows // page_size, page_size, H, D]`. Page 0 (slots 0..page_size-1) is the
dummy page: the allocator never hands it out, padding reads and writes it.

Plans. `init_forward_metadata` plans once per batch, every layer reuses the plan:
- DECODE: `BatchDecodeWithPagedKVCacheWrapper` (tensor cores for GQA groups >= 4).
- EXTEND and MIXED: `BatchPrefillWithPagedKVCacheWrapper` over the whole sequence
  (cached prefix + new tokens, whose K/V `forward` writes into the pool first),
  causal. FlashInfer aligns the causal mask bottom-right (query t of a request with
  qo_len new tokens sees kv positions <= kv_len - qo_len + t), which is exactly
  "prefix plus new tokens at or before me"; a MIXED batch's decodes are requests
  with qo_len 1. One kernel per layer and one plan per batch; SGLang's alternative
  (ragged kernel over the new tokens + paged kernel over the prefix, merged with
  `merge_state`) saves reading the new K/V back through page indices and is the
  optimisation to reach for if long prefills measure slow.
- CUDA-graph decode: one wrapper per captured batch size, `use_cuda_graph=True`,
  over fixed indptr/indices/last_page_len buffers; re-planned before every replay.

No host sync on the hot path: page-table arithmetic runs on the host from the
batch's `*_cpu` lists, the page indices are gathered on the device from
`req_to_token` with vectorized ops (sizes known on the host, so no `nonzero`), and
host metadata goes up from pinned memory with `non_blocking=True`.

`flashinfer` is imported only when a backend is built, so this module imports on
machines without CUDA or FlashInfer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kernels.attention.base import AttentionBatch
    from kernels.attention.base import DecodeAttentionPlan, KVCache

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-kv partials)
TENSOR_CORE_MIN_GQA_GROUP = 4  # SGLang's rule: prefill-style decode kernels pay off from here


class FlashInferUnavailable(RuntimeError):
    """The FlashInfer backend was asked for where it cannot run."""


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise FlashInferUnavailable(
            "attention_backend=flashinfer needs the flashinfer-python package "
            "(pip install 'sluice[gpu]'); or use attention_backend=torch"
        ) from e
    return flashinfer


def check_cuda_device(device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise FlashInferUnavailable(
            f"attention_backend=flashinfer needs a CUDA device (got device={device}, "
            f"torch.cuda.is_available()={torch.cuda.is_available()}); use attention_backend=torch"
        )


# --- page-table arithmetic: pure, host-side, CPU-testable --------------------------------


def paged_kv_layout(seq_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request KV lengths (host int tensor) -> (kv_indptr [bs+1], kv_last_page_len [bs]), int32.

    Request i owns pages kv_indices[kv_indptr[i]:kv_indptr[i+1]]; its last page holds
    kv_last_page_len[i] in 1..page_size tokens.
    """
    seq_lens = seq_lens.to(torch.int32)
    pages = (seq_lens + page_size - 1) // page_size
    indptr = torch.zeros(seq_lens.numel() + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    return indptr, seq_lens - (pages - 1) * page_size


def qo_indptr(extend_lens: list[int]) -> torch.Tensor:
    """Packed new-token offsets: request i's queries are rows qo[i]:qo[i+1]. int32 [bs+1]."""
    out = torch.zeros(len(extend_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(extend_lens, dtype=torch.int32), 0, out=out[1:])
    return out


def padded_seq_lens(seq_lens: list[int], bucket: int) -> list[int]:
    """A decode batch padded to a CUDA-graph bucket: each padding row is a
    one-token request on the dummy page."""
    assert len(seq_lens) <= bucket, (len(seq_lens), bucket)
    return seq_lens + [1] * (bucket - len(seq_lens))


def gather_kv_indices(
    req_to_token: torch.Tensor, rows: torch.Tensor, kv_indptr: torch.Tensor, num_pages: int, page_size: int
) -> torch.Tensor:
    """Page ids of every request, concatenated: int32 [num_pages], on req_to_token's device.

    Page j of request i starts at position j*page_size, whose slot is page-aligned
    (the allocator hands out whole pages and radix matches are page-aligned), so
    its page id is `req_to_token[row_i, j*page_size] // page_size`. `num_pages`
    (= kv_indptr[-1]) comes from the host so that no op here waits on the device.
    """
    dev = req_to_token.device
    indptr = kv_indptr.to(dev, torch.int64)
    counts = indptr[1:] - indptr[:-1]
    row_of = torch.repeat_interleave(rows.to(dev, torch.int64), counts, output_size=num_pages)
    first = torch.repeat_interleave(indptr[:-1], counts, output_size=num_pages)
    page_in_req = torch.arange(num_pages, device=dev) - first
    return (req_to_token[row_of, page_in_req * page_size] // page_size).to(torch.int32)


# --- the backend ---------------------------------------------------------------------------


class FlashInferBackend:
    def __init__(
        self,
        device: torch.device | str,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
        sm_scale: float | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        use_tensor_cores: bool | None = None,
        kernel_backend: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        check_cuda_device(self.device)
        kv_dtype = kv_dtype or dtype
        if dtype not in (torch.float16, torch.bfloat16) or kv_dtype not in (torch.float16, torch.bfloat16):
            raise FlashInferUnavailable(
                f"FlashInfer attention runs in float16/bfloat16, not {dtype} (KV {kv_dtype}); use attention_backend=torch"
            )
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.fi = import_flashinfer()
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.page_size = page_size
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.sm_scale = sm_scale if sm_scale is not None else head_dim**-0.5
        self.use_tensor_cores = (
            use_tensor_cores if use_tensor_cores is not None else num_qo_heads // num_kv_heads >= TENSOR_CORE_MIN_GQA_GROUP
        )
        self.kernel_backend = kernel_backend
        self._cuda = self.device.type == "cuda"
        # One float workspace shared by every wrapper: kernels run in stream order,
        # so two wrappers never use it at the same time.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=kernel_backend)
        self.decode = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, backend=kernel_backend
        )
        self.active: Any = None  # the wrapper whose plan `forward` runs
        self.graph_wrappers: dict[int, Any] = {}  # captured batch size -> CUDA-graph decode wrapper
        self._graph_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._kv_pages: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_pool: KVCache | None = None
        # A wrapper's plan() stages its schedule in a pinned host buffer and copies it
        # up asynchronously; the next plan() must not overwrite that buffer before the
        # copy ran. Waiting on the previous plan's event is free in steady state (the
        # worker is at most one batch ahead of the device).
        self._plan_done: torch.cuda.Event | None = torch.cuda.Event() if self._cuda else None
        self._planned = False

    # ---- helpers ---------------------------------------------------------------------
    def _bind_pool(self, pool: KVCache) -> None:
        if pool is self._kv_pool:
            return
        p = self.page_size
        pages = pool.k_buffer[0].shape[0] // p
        self._kv_pages = [
            (k[: pages * p].view(pages, p, pool.num_kv_heads, pool.head_dim), v[: pages * p].view(pages, p, pool.num_kv_heads, pool.head_dim))
            for k, v in zip(pool.k_buffer, pool.v_buffer)
        ]
        self._kv_pool = pool

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self._cuda else t

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        return self._host(t).to(self.device, non_blocking=True)

    def _before_plan(self) -> None:
        if self._plan_done is not None and self._planned:
            self._plan_done.synchronize()

    def _after_plan(self) -> None:
        if self._plan_done is not None:
            self._plan_done.record()
        self._planned = True

    def _plan_decode(self, wrapper: Any, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> None:
        self._before_plan()
        wrapper.plan(
            self._host(indptr), indices, self._host(last),
            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale,
        )  # fmt: skip
        self._after_plan()
        self.active = wrapper

    # ---- AttentionBackend --------------------------------------------------------------
    def decode_attention_plan(self) -> DecodeAttentionPlan | None:
        return None  # a CPU kernel's plan; this backend's decode is FlashInfer's

    def init_forward_metadata(self, fb: AttentionBatch) -> None:
        self._bind_pool(fb.kv_pool)
        indptr, last = paged_kv_layout(torch.tensor(fb.seq_lens_cpu, dtype=torch.int32), self.page_size)
        num_pages = int(indptr[-1])
        indices = gather_kv_indices(fb.req_to_token, fb.req_pool_indices, self._upload(indptr), num_pages, self.page_size)
        if fb.forward_mode.is_decode():
            self._plan_decode(self.decode, indptr, indices, last)
            return
        self._before_plan()
        self.prefill.plan(
            self._host(qo_indptr(fb.extend_seq_lens_cpu)), self._host(indptr), indices, self._host(last),
            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=True, q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale,
        )  # fmt: skip
        self._after_plan()
        self.active = self.prefill

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, scaling: float, fb: AttentionBatch
    ) -> torch.Tensor:
        fb.kv_pool.set_kv(layer_id, fb.out_cache_loc, k, v)  # one indexed copy each for K and V
        if scaling != self.sm_scale:  # the plan fixed sm_scale; fold any other scale into q
            q = q * (scaling / self.sm_scale)
        return self.active.run(q.contiguous(), self._kv_pages[layer_id])

    # ---- CUDA-graph decode (driven by runtime.model_executor.cuda_graph_runner) -------------------------
    def init_cuda_graph_state(self, max_bs: int, max_pages_per_req: int) -> None:
        """Fixed buffers every graph wrapper plans into: only one graph replays at a
        time, and each replay re-plans its own wrapper first."""
        dev = self.device
        self._graph_bufs = (
            torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),  # kv_indptr
            torch.zeros(max_bs * max_pages_per_req, dtype=torch.int32, device=dev),  # kv_indices
            torch.ones(max_bs, dtype=torch.int32, device=dev),  # kv_last_page_len
        )

    def init_forward_metadata_capture_cuda_graph(self, bucket: int, fb: AttentionBatch) -> None:
        """Make (once) and plan the wrapper graph `bucket` captures; `fb` is the
        runner's static batch (all padding)."""
        assert self._graph_bufs is not None, "init_cuda_graph_state first"
        indptr_buf, indices_buf, last_buf = self._graph_bufs
        if bucket not in self.graph_wrappers:
            self.graph_wrappers[bucket] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=indptr_buf[: bucket + 1],
                paged_kv_indices_buffer=indices_buf,
                paged_kv_last_page_len_buffer=last_buf[:bucket],
                backend=self.kernel_backend,
            )
        self._bind_pool(fb.kv_pool)
        self._plan_padded(self.graph_wrappers[bucket], bucket, [], fb)

    def init_forward_metadata_replay_cuda_graph(self, bucket: int, fb: AttentionBatch) -> None:
        """Plan graph `bucket` for decode batch `fb` (fb.batch_size <= bucket)."""
        self._bind_pool(fb.kv_pool)
        self._plan_padded(self.graph_wrappers[bucket], bucket, fb.seq_lens_cpu, fb)

    def _plan_padded(self, wrapper: Any, bucket: int, seq_lens: list[int], fb: AttentionBatch) -> None:
        bs = len(seq_lens)
        indptr, last = paged_kv_layout(torch.tensor(padded_seq_lens(seq_lens, bucket), dtype=torch.int32), self.page_size)
        real_pages = int(indptr[bs])
        # Padding rows own one page each: page 0, the dummy page (zeros beyond real_pages).
        indices = torch.zeros(int(indptr[-1]), dtype=torch.int32, device=self.device)
        if bs:
            rows = fb.req_pool_indices[:bs]
            indices[:real_pages] = gather_kv_indices(fb.req_to_token, rows, self._upload(indptr[: bs + 1]), real_pages, self.page_size)
        self._plan_decode(wrapper, indptr, indices, last)


__all__ = [
    "FlashInferBackend",
    "FlashInferUnavailable",
    "gather_kv_indices",
    "padded_seq_lens",
    "paged_kv_layout",
    "qo_indptr",
]
