"""Turns settings into a running stack: resolves the autos, loads the model, sizes
the pools. Everything here runs once, at Engine construction."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from config.settings import EngineSettings, SettingsError
from kernels.attention import create_attention_backend
from runtime.model_executor.gpu_defaults import default_cuda_graph_max_bs, default_max_running_requests, gpu_memory_defaults, kv_pool_tokens
from runtime.mem.kv_pool import KVPool
from runtime.mem.pools import MemoryPools
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import load_model, prepare_model_dir, resolve_dtype
from runtime.model_executor.model_runner import ModelRunner
from runtime.model_executor.worker import Worker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = structlog.get_logger("sluice.engine")

CPU_KV_BUDGET_BYTES = 4 << 30  # default KV budget on CPU: min(this, a quarter of RAM)


@dataclass(frozen=True, slots=True)
class EngineStack:
    """Everything an Engine runs on, built once from resolved settings."""

    settings: EngineSettings  # every auto knob resolved to a value
    model_config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    pools: MemoryPools
    worker: Worker
    model_dir: str


def resolve_device(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise SettingsError("device=cuda but no CUDA device is available")
    return setting


def _cpu_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def resolve_settings(settings: EngineSettings, device: str, config: ModelConfig, weight_bytes: int) -> EngineSettings:
    """Fill every auto knob with a number. On CUDA this runs with the weights resident."""
    per_token = KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, config.kv_dtype)
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        gpu = gpu_memory_defaults(
            total, settings.chunked_prefill_size, settings.cuda_graph_max_bs, settings.mem_fraction_static, settings.max_prefill_tokens
        )
        max_total = settings.max_total_tokens or kv_pool_tokens(free, total, gpu.mem_fraction_static, per_token, settings.page_size)
    else:
        gpu = None
        max_total = settings.max_total_tokens or min(CPU_KV_BUDGET_BYTES, _cpu_ram_bytes() // 4) // per_token
    max_total = max_total - max_total % settings.page_size
    if max_total < settings.page_size * 2:
        raise SettingsError(f"max_total_tokens={max_total} is too small")
    max_running = settings.max_running_requests or (default_max_running_requests(max_total, config.context_len) if gpu else 256)
    chunk = settings.chunked_prefill_size
    if chunk is None:
        chunk = gpu.chunked_prefill_size if gpu else 1024
    backend = settings.attention_backend
    if backend == "auto":  # FlashInfer kernels take fp16/bf16 only
        backend = "flashinfer" if device == "cuda" and config.dtype != torch.float32 else "torch"
    cuda_graph_max_bs = settings.cuda_graph_max_bs or (default_cuda_graph_max_bs(gpu.cuda_graph_max_bs, max_running) if gpu else None)
    return dataclasses.replace(
        settings,
        device=device,
        context_length=config.context_len,
        max_total_tokens=max_total,
        max_running_requests=max_running,
        chunked_prefill_size=chunk,
        attention_backend=backend,
        cuda_graph_max_bs=cuda_graph_max_bs,
        mem_fraction_static=gpu.mem_fraction_static if gpu else settings.mem_fraction_static,
        random_seed=settings.random_seed if settings.random_seed is not None else 0,
    )


def _pools(settings: EngineSettings, config: ModelConfig) -> MemoryPools:
    assert settings.max_total_tokens and settings.max_running_requests, "resolve_settings first"
    return MemoryPools.build(
        settings.max_running_requests, config.context_len, settings.max_total_tokens, settings.page_size, settings.disable_radix_cache
    )


def build_stub(settings: EngineSettings, *, constant_token: int | None = None) -> EngineStack:
    """The real scheduler, pools and tokenizer of `settings.model_path` (default: the
    embedded model) around a StubWorker: no weights, no KV tensors, deterministic
    tokens (see runtime/model_executor/stub_worker.py). For fast tests and benchmarks."""
    from transformers import AutoTokenizer

    from runtime.model_executor.stub_worker import StubWorker

    model_dir = prepare_model_dir(settings.model_path, settings.load_format)
    config = ModelConfig.from_pretrained(model_dir, torch.float32, settings.context_length)
    settings = resolve_settings(dataclasses.replace(settings, device="cpu"), "cpu", config, 0)
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path or model_dir)
    pools = _pools(settings, config)
    assert settings.max_total_tokens
    worker = StubWorker(
        pools.num_rows, config.context_len, settings.max_total_tokens + settings.page_size, config.vocab_size, constant_token=constant_token
    )
    return EngineStack(settings, config, tokenizer, pools, worker, str(model_dir))


def build(settings: EngineSettings) -> EngineStack:
    """Load the model and size the pools for `settings`."""
    from transformers import AutoTokenizer

    device = resolve_device(settings.device)
    if device == "cpu" and settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    dtype = resolve_dtype(settings.dtype, device)
    model_dir = prepare_model_dir(settings.model_path, settings.load_format)
    config = ModelConfig.from_pretrained(model_dir, dtype, settings.context_length, settings.kv_cache_dtype)
    model = load_model(model_dir, config, settings.load_format, device, settings.random_seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    settings = resolve_settings(settings, device, config, weight_bytes)
    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path or model_dir)
    pools = _pools(settings, config)
    kv_dtype = config.kv_dtype
    kv_pool = KVPool(pools.max_total_num_tokens + settings.page_size, config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype, device)
    backend = create_attention_backend(
        settings.attention_backend, device, use_cpu_kernel=not settings.disable_cpu_kernels,
        num_qo_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        page_size=settings.page_size, dtype=dtype, kv_dtype=kv_dtype,
    )  # fmt: skip
    runner = ModelRunner(model, kv_pool, backend, pools.num_rows, config.context_len, config.vocab_size, device)
    if device == "cuda" and settings.attention_backend == "flashinfer" and not settings.disable_cuda_graph and settings.cuda_graph_max_bs:
        from runtime.model_executor.cuda_graph_runner import CudaGraphRunner

        start = time.monotonic()
        runner.graph_runner = CudaGraphRunner(model, backend, kv_pool, runner.req_to_token, settings.cuda_graph_max_bs, stream=runner.stream)
        runner.graph_runner.capture()
        log.info("CUDA graphs captured", batch_sizes=runner.graph_runner.buckets, seconds=round(time.monotonic() - start, 1))
    log.info(
        "engine ready",
        model=str(model_dir),
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        max_total_num_tokens=settings.max_total_tokens,
        max_running_requests=settings.max_running_requests,
        chunked_prefill_size=settings.chunked_prefill_size,
        kv_cache_dtype=str(kv_dtype).removeprefix("torch."),
        kv_gib=round(KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, kv_dtype) * pools.max_total_num_tokens / (1 << 30), 3),
    )
    return EngineStack(settings, config, tokenizer, pools, runner, str(model_dir))
