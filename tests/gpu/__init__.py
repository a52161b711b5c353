"""Helpers shared by the GPU suite (tests/gpu, real FlashInfer on CUDA) and its CPU
stand-in (tests/test_gpu_imports.py, a reference FlashInfer written in torch).

`run_rounds` feeds sequences round by round through bench/paged_rounds.py's
`PagedRequests` (here with shuffled pages: a request's pages are not contiguous).

`fake_flashinfer()` is a module with FlashInfer 0.7's paged-wrapper API
(`plan`/`run`, CUDA-graph mode writing into caller buffers) whose kernels are a
plain-torch reading of FlashInfer's documented semantics: pages
kv_indices[kv_indptr[i]:kv_indptr[i+1]], the last one holding kv_last_page_len[i]
tokens, causal masks aligned bottom-right. It lets the backend's metadata and the
graph runner's padding be checked on machines without a GPU.
"""

from __future__ import annotations

import os
import shutil
import types
from pathlib import Path
from typing import Any

import torch

from bench.paged_rounds import PagedRequests

TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=49152,  # SmolLM2's tokenizer, so the engine can detokenize
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,  # GQA group 4: the tensor-core decode path
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


def write_model_dir(path: Path, **overrides: Any) -> Path:
    """config.json of a tiny Llama + the embedded SmolLM2 tokenizer files: a model
    directory for `load_format="dummy"` (no weights)."""
    from transformers import LlamaConfig

    from runtime.model_executor.model_loader import COMPLETE_MARKER, prepare_model_dir

    # SLUICE_TOKENIZER_DIR: a folder with the tokenizer files, for GPU machines that
    # lack the embedded GGUF (it is too large to carry to a lent machine).
    tok_dir = os.environ.get("SLUICE_TOKENIZER_DIR")
    src = Path(tok_dir) if tok_dir else prepare_model_dir(None, "auto")
    path.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", COMPLETE_MARKER):
            shutil.copy(f, path / f.name)
    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    return path


@torch.inference_mode()
def run_rounds(model: torch.nn.Module, batches: PagedRequests, seqs: list[list[int]], rounds: list[list[int]], graph_runner: Any = None) -> list[torch.Tensor]:
    """Feed `rounds[k][i]` more tokens of `seqs[i]` in round k; float32 logits [len, vocab] per
    sequence. Decode rounds go through `graph_runner` when one is given."""
    fed = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for sizes in rounds:
        chunk = {i: seqs[i][fed[i] : fed[i] + n] for i, n in enumerate(sizes) if n}
        use_graph = graph_runner is not None and all(n == 1 for n in sizes if n)
        fb = batches.batch(chunk, plan=not use_graph)
        if use_graph:
            assert graph_runner.can_run(fb)
            logits = graph_runner.replay(fb)
        else:
            logits = model.compute_logits(model(fb.input_ids, fb.positions, fb))
        for i, piece in zip(chunk, logits.float().cpu().split(fb.extend_seq_lens_cpu)):
            out[i].append(piece)
            fed[i] += len(chunk[i])
    assert fed == [len(s) for s in seqs], "rounds must cover every token"
    return [torch.cat(parts) for parts in out]


# --- a reference FlashInfer ------------------------------------------------------------------


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    causal: bool,
    sm_scale: float,
) -> torch.Tensor:
    k_pages, v_pages = kv_cache  # [pages, page_size, Hkv, D] (NHD)
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    qo, kvp, idx, last = (t.cpu().long() for t in (qo_indptr, kv_indptr, kv_indices, last_page_len))
    for i in range(len(qo) - 1):
        pages = idx[kvp[i] : kvp[i + 1]].to(q.device)
        kv_len = (len(pages) - 1) * page_size + int(last[i])
        k = k_pages[pages].reshape(-1, hkv, q.shape[2])[:kv_len].float().repeat_interleave(group, dim=1)
        v = v_pages[pages].reshape(-1, hkv, q.shape[2])[:kv_len].float().repeat_interleave(group, dim=1)
        qi = q[qo[i] : qo[i + 1]].float()
        n = qi.shape[0]
        s = torch.einsum("lhd,shd->hls", qi, k) * sm_scale
        if causal:
            allowed = torch.arange(kv_len, device=q.device)[None, :] <= (kv_len - n + torch.arange(n, device=q.device))[:, None]
            s = s.masked_fill(~allowed, float("-inf"))
        out[qo[i] : qo[i + 1]] = torch.einsum("hls,shd->lhd", s.softmax(-1), v).to(q.dtype)
    return out


class _FakePrefillWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto", **_: Any) -> None:
        assert kv_layout == "NHD"
        self.plans = 0

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *, causal: bool = False,
             sm_scale: float | None = None, **_: Any) -> None:  # fmt: skip
        assert kv_indptr.dtype == torch.int32 and kv_indices.dtype == torch.int32 and last.dtype == torch.int32
        assert len(kv_indices) == int(kv_indptr[-1]) and bool((last >= 1).all()) and bool((last <= page_size).all())
        self.meta = (qo_indptr.clone(), kv_indptr.clone(), kv_indices.clone(), last.clone())
        self.causal, self.sm_scale = causal, sm_scale if sm_scale is not None else head_dim**-0.5
        self.plans += 1

    def run(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return paged_attention_reference(q, kv_cache, *self.meta, self.causal, self.sm_scale)


class _FakeDecodeWrapper:
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto", **_: Any) -> None:  # fmt: skip
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        if use_cuda_graph:
            assert paged_kv_indptr_buffer is not None and paged_kv_indices_buffer is not None
            assert paged_kv_last_page_len_buffer is not None
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.plans = 0

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, *, sm_scale: float | None = None, **_: Any) -> None:  # fmt: skip
        assert indptr.dtype == torch.int32 and indices.dtype == torch.int32 and last.dtype == torch.int32
        assert len(indices) == int(indptr[-1]) and bool((last >= 1).all()) and bool((last <= page_size).all())
        self.sm_scale = sm_scale if sm_scale is not None else head_dim**-0.5
        if self.use_cuda_graph:  # as FlashInfer: the batch size is frozen, metadata lives in the buffers
            indptr_buf, indices_buf, last_buf = self.bufs
            assert len(last) == len(last_buf), "CUDA-graph wrappers plan their captured batch size only"
            indptr_buf.copy_(indptr)
            last_buf.copy_(last)
            indices_buf[: len(indices)].copy_(indices)
        else:
            self.bufs = (indptr.clone(), indices.clone(), last.clone())
        self.plans += 1

    def run(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        indptr, indices, last = self.bufs
        assert indptr is not None and indices is not None and last is not None
        qo = torch.arange(len(last) + 1, dtype=torch.int32)
        return paged_attention_reference(q, kv_cache, qo, indptr, indices[: int(indptr[-1])], last, False, self.sm_scale)


def fake_flashinfer() -> types.ModuleType:
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePrefillWrapper  # type: ignore[attr-defined]
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecodeWrapper  # type: ignore[attr-defined]
    mod.__version__ = "0.0-fake"  # type: ignore[attr-defined]
    return mod
