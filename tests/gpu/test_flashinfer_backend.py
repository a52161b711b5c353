"""FlashInfer against the torch-native reference, on CUDA in bfloat16: the attention
op alone (random q/k/v, every forward mode) and a whole tiny Llama (logits)."""

from __future__ import annotations

import types
import pytest
import torch

from kernels.attention.flashinfer_backend import FlashInferBackend
from kernels.attention.torch_native import TorchNativeBackend
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import load_model
from bench.paged_rounds import PagedRequests
from tests.gpu import run_rounds, write_model_dir

pytestmark = pytest.mark.gpu

DEV = "cuda"
ROUNDS_3 = [[30, 8, 0], [8, 1, 5], [1, 0, 1], [1, 1, 1]]  # EXTEND; MIXED over prefixes; DECODE; DECODE


def shapes(heads: int, kv_heads: int, head_dim: int = 128, layers: int = 1) -> types.SimpleNamespace:
    return types.SimpleNamespace(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16, kv_dtype=torch.bfloat16)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (8, 4), (32, 8)])
def test_attention_matches_torch_native_in_every_mode(page_size: int, heads: int, kv_heads: int) -> None:
    cfg = shapes(heads, kv_heads)
    fi = FlashInferBackend(DEV, heads, kv_heads, cfg.head_dim, page_size, torch.bfloat16)
    ref = TorchNativeBackend()
    batches = PagedRequests(cfg, 3, 256, page_size=page_size, backend=ref, device=DEV, seed=0)  # type: ignore[arg-type]
    gen = torch.Generator(device=DEV).manual_seed(0)
    scale = cfg.head_dim**-0.5
    modes = []
    for sizes in ROUNDS_3 + [[100, 0, 40]]:
        fb = batches.batch({i: [0] * n for i, n in enumerate(sizes) if n})  # plans the reference
        fi.init_forward_metadata(fb)
        modes.append(fb.forward_mode.name)
        t = fb.num_tokens
        q = torch.randn(t, heads, cfg.head_dim, device=DEV, generator=gen, dtype=torch.bfloat16)
        k = torch.randn(t, kv_heads, cfg.head_dim, device=DEV, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(t, kv_heads, cfg.head_dim, device=DEV, generator=gen, dtype=torch.bfloat16)
        want = ref.forward(q, k, v, 0, scale, fb)
        got = fi.forward(q, k, v, 0, scale, fb)  # writes the same k/v again
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert modes == ["EXTEND", "MIXED", "DECODE", "DECODE", "EXTEND"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelConfig, torch.nn.Module]:
    path = write_model_dir(tmp_path_factory.mktemp("tiny-backend"), vocab_size=512)
    config = ModelConfig.from_pretrained(path, torch.bfloat16)
    return config, load_model(path, config, "dummy", DEV, seed=5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_tiny_llama_logits_match_torch_native(tiny: tuple[ModelConfig, torch.nn.Module], page_size: int) -> None:
    config, model = tiny
    assert {p.device.type for p in model.parameters()} == {"cuda"}  # dummy weights are built on the GPU
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (40, 9, 6)]
    fi = FlashInferBackend(DEV, config.num_heads, config.num_kv_heads, config.head_dim, page_size, config.dtype)
    ours = run_rounds(model, PagedRequests(config, 3, page_size=page_size, backend=fi, device=DEV, seed=0), seqs, ROUNDS_3[:3] + [[1, 0, 0]])
    ref = run_rounds(model, PagedRequests(config, 3, page_size=page_size, device=DEV, seed=0), seqs, ROUNDS_3[:3] + [[1, 0, 0]])
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=0.03 * b.abs().max().item(), rtol=0.0)
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        assert cos.min().item() > 0.999, cos


def test_workspace_and_wrappers_are_built_once(tiny: tuple[ModelConfig, torch.nn.Module]) -> None:
    config, model = tiny
    fi = FlashInferBackend(DEV, config.num_heads, config.num_kv_heads, config.head_dim, 1, config.dtype)
    workspace, prefill, decode = fi.workspace.data_ptr(), fi.prefill, fi.decode
    run_rounds(model, PagedRequests(config, 2, backend=fi, device=DEV, seed=0), [[1] * 10, [2] * 5], [[9, 4], [1, 1]])
    assert (fi.workspace.data_ptr(), fi.prefill, fi.decode) == (workspace, prefill, decode)
    assert fi.use_tensor_cores  # GQA group 4
