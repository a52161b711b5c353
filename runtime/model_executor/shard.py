"""build_shard: one rank's model, KV pool, attention backend and ModelRunner.

Every tensor-parallel rank runs this (rank 0 in the server process, the others in
their worker processes); with tp_size 1 it is the whole model. Ranks agree on the
KV pool size and the request rows (the minimum over ranks), because rank 0's
scheduler hands out slots and rows that every rank's pool must hold.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from config.settings import EngineSettings, SettingsError
from kernels.attention import create_attention_backend
from kernels.cpu import load_cpu_ops
from runtime.distributed.parallel_state import get_tp_size, init_tensor_parallel
from runtime.layers.linear import kv_heads_per_rank
from runtime.mem.kv_pool import KVPool
from runtime.mem.pools import MemoryPools
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import load_model, prepare_model_dir
from runtime.model_executor.model_runner import ModelRunner
from runtime.model_executor.pooler import pooler_for, resolve_pooling
from runtime.model_executor.resolve import (
    resolve_cpu_threads,
    resolve_deterministic,
    resolve_device,
    resolve_quantization_and_dtype,
    resolve_settings,
)

log = structlog.get_logger("sluice.engine")


@dataclass(frozen=True, slots=True)
class Shard:
    settings: EngineSettings  # resolved, and identical on every rank
    config: ModelConfig
    runner: ModelRunner
    model_dir: Path


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Refuse a split the heads do not allow, before any rank is started."""
    if config.num_heads % tp_size:
        raise SettingsError(f"tp_size={tp_size} must divide the model's num_attention_heads={config.num_heads}")
    try:
        kv_heads_per_rank(config.num_kv_heads, tp_size)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def _agree_min(settings: EngineSettings, device: torch.device) -> EngineSettings:
    """Every rank takes the smallest KV pool and row count any rank can hold."""
    if get_tp_size() == 1:
        return settings
    assert settings.max_total_tokens and settings.max_running_requests
    values = torch.tensor([settings.max_total_tokens, settings.max_running_requests], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MIN)
    max_total, max_running = values.tolist()
    return dataclasses.replace(settings, max_total_tokens=max_total, max_running_requests=max_running)


def build_shard(settings: EngineSettings, rank: int, init_method: str | None) -> Shard:
    device = resolve_device(settings.device)
    if settings.quantization not in ("auto", "none") and device != "cpu":  # the kernels are torch's CPU ones
        raise SettingsError(f"quantization={settings.quantization} runs on CPU only (device={device})")
    tp = settings.tp_size
    per_node = tp // settings.nnodes
    dev = torch.device(device, rank % per_node) if device == "cuda" else torch.device(device)
    if tp > 1:
        assert init_method is not None
        init_tensor_parallel(rank, tp, init_method, dev, settings.dist_timeout, shm=not settings.disable_custom_all_reduce)
    if device == "cpu":
        torch.set_num_threads(resolve_cpu_threads(settings.num_threads, per_node))
    if settings.enable_deterministic_inference and (device != "cpu" or settings.disable_cpu_kernels):
        raise SettingsError("enable_deterministic_inference runs on CPU with the compiled kernels (not disable_cpu_kernels)")
    model_dir = prepare_model_dir(settings.model_path, settings.load_format)
    settings, quantization, dtype = resolve_quantization_and_dtype(settings, device, model_dir)
    settings = resolve_deterministic(settings, device, quantization)
    deterministic = bool(settings.enable_deterministic_inference)
    config = ModelConfig.from_pretrained(model_dir, dtype, settings.context_length, settings.kv_cache_dtype)
    kv_heads = kv_heads_per_rank(config.num_kv_heads, tp)
    use_kernels = device == "cpu" and not settings.disable_cpu_kernels
    cpu_ops = load_cpu_ops() if use_kernels else None
    model = load_model(model_dir, config, settings.load_format, str(dev), settings.random_seed, quantization, cpu_ops=cpu_ops)
    settings = _agree_min(resolve_pooling(resolve_settings(settings, device, config, kv_heads), model_dir), dev)
    assert settings.max_total_tokens and settings.max_running_requests
    kv_pool = KVPool(settings.max_total_tokens + settings.page_size, config.num_layers, kv_heads, config.head_dim, config.kv_dtype, dev)
    backend = create_attention_backend(
        settings.attention_backend, device, use_cpu_kernel=use_kernels, deterministic=deterministic,
        num_qo_heads=config.num_heads // tp, num_kv_heads=kv_heads, head_dim=config.head_dim,
        page_size=settings.page_size, dtype=dtype, kv_dtype=config.kv_dtype,
    )  # fmt: skip
    rows = MemoryPools.rows_for(settings.max_running_requests)
    runner = ModelRunner(
        model, kv_pool, backend, rows, config.context_len, config.vocab_size, dev, cpu_ops=cpu_ops, deterministic=deterministic
    )
    runner.pooler = pooler_for(settings)
    graphs = device == "cuda" and settings.attention_backend == "flashinfer" and not settings.disable_cuda_graph
    if graphs and settings.cuda_graph_max_bs and tp == 1:  # graphs around collectives: not yet
        from runtime.model_executor.cuda_graph_runner import CudaGraphRunner

        start = time.monotonic()
        runner.graph_runner = CudaGraphRunner(model, backend, kv_pool, runner.req_to_token, settings.cuda_graph_max_bs, stream=runner.stream)
        runner.graph_runner.capture()
        log.info("CUDA graphs captured", batch_sizes=runner.graph_runner.buckets, seconds=round(time.monotonic() - start, 1))
    return Shard(settings, config, runner, model_dir)
