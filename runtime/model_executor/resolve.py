"""Resolve the settings' auto knobs for a model on a device: the CPU mode (weight
quantization, dtype, threads), KV pool size, request rows, chunk size, attention
backend, CUDA-graph batch sizes."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from pathlib import Path

import structlog
import torch

from config.settings import EngineSettings, SettingsError
from runtime.layers.quantization import QuantizationName
from runtime.mem.kv_pool import KVPool
from runtime.model_config import ModelConfig
from runtime.model_executor.gpu_defaults import default_cuda_graph_max_bs, default_max_running_requests, gpu_memory_defaults, kv_pool_tokens
from runtime.model_executor.model_loader import gguf_source

log = structlog.get_logger("sluice.engine")

CPU_KV_BUDGET_BYTES = 4 << 30  # default KV budget on CPU: min(this, a quarter of RAM)


def resolve_device(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise SettingsError("device=cuda but no CUDA device is available")
    return setting


def cpu_bf16_feature() -> str | None:
    """The CPU feature that makes bf16 matmuls native (amx_bf16, else avx512_bf16), or None."""
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        flags = set(Path("/proc/cpuinfo").read_text().split())
    if not flags:  # no /proc: torch >= 2.6 reports the same capabilities
        caps = getattr(torch._C._cpu, "_get_cpu_capability", lambda: {})()
        flags = {name for name, on in caps.items() if on}
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


def resolve_dtype(setting: str, device: str) -> torch.dtype:
    """`auto` = bfloat16 on CUDA (float16 before Ampere) and on bf16-capable CPUs, else float32."""
    if setting != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[setting]
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if on_cuda:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    feature = cpu_bf16_feature()
    dtype = torch.bfloat16 if feature else torch.float32
    log.info(
        "dtype auto resolved",
        dtype=str(dtype).removeprefix("torch."),
        reason=f"{feature} in the CPU flags" if feature else "no amx_bf16 / avx512_bf16: bf16 would be emulated",
    )
    return dtype


def resolve_quantization_and_dtype(
    settings: EngineSettings, device: str, model_dir: Path
) -> tuple[EngineSettings, QuantizationName, torch.dtype]:
    """`quantization=auto` and `dtype=auto` for this model on this device, logged with why.

    On CPU a GGUF model runs its linear layers from the file's own Q4/Q8 blocks (gguf):
    the fastest decode that keeps >= 99% top-1 agreement with the float32 model (bench
    items 11, 16), and with it float32 for everything else (residual stream, attention,
    the LM head as exact Q8 blocks; the KV cache float16, below): bfloat16 there drops
    agreement to 98.2% (item 11). So at every tp_size: each rank packs its share of the
    blocks (a 1-row decode step at tp 2 twice as fast as float32 weights, 16 rows alike;
    item 35). Anything else (an HF directory, dummy weights, CUDA, where gguf's kernels do
    not run) runs unquantized in the dtype `resolve_dtype` picks from the CPU's flags or
    the GPU.
    """
    setting = settings.quantization
    quant: QuantizationName
    if setting == "auto":
        gguf_file = settings.load_format != "dummy" and gguf_source(model_dir) is not None
        gguf = device == "cpu" and gguf_file
        quant = "gguf" if gguf else "none"
        reason = "a GGUF model on CPU: its own blocks" if gguf else "not a GGUF model on CPU"
    else:
        quant, reason = setting, "set explicitly"
    if settings.dtype == "auto" and quant == "gguf":
        dtype = torch.float32
        log.info("dtype auto resolved", dtype="float32", reason="quantization=gguf keeps a float32 residual stream (99% top-1 bar)")
    else:
        dtype = resolve_dtype(settings.dtype, device)
    log.info("quantization resolved", quantization=quant, setting=setting, reason=reason)
    settings = dataclasses.replace(settings, quantization=quant)
    if settings.kv_cache_dtype == "auto" and quant == "gguf" and device == "cpu" and dtype == torch.float32:
        # A decode step at 16 streams of 130 tokens read more KV (96 MB in float32) than
        # weights; float16 halves it at no measured agreement cost (bench/RESULTS.md item 18).
        settings = dataclasses.replace(settings, kv_cache_dtype="float16")
        log.info("kv_cache_dtype auto resolved", kv_cache_dtype="float16", reason="quantization=gguf on CPU: half the KV bytes")
    return settings, quant, dtype


def resolve_deterministic(settings: EngineSettings, device: str, quantization: QuantizationName) -> EngineSettings:
    """`enable_deterministic_inference` unset: on where its cost was measured to be none,
    logged with why. That is the GGUF blocks on a CPU whose bfloat16 tiles are AVX512-BF16
    (bench/RESULTS.md item 25: prefill, decode, serving and offline within noise or faster,
    a chat's next turn as fast). Off on AMX CPUs (not measured since the mode's kernels
    changed), on AVX2 without native bfloat16 (item 33: a 16-row decode step +18% on a Zen 1,
    its answers on the Q4 blocks where the default takes the float32 panels from 6 rows), in
    float modes (16-row blocks), across tensor-parallel ranks (not measured) and off CPU
    (the mode needs the CPU kernels)."""
    if settings.enable_deterministic_inference is not None:
        return settings
    if device != "cpu" or settings.disable_cpu_kernels:
        on, reason = False, "needs the CPU kernels"
    elif quantization != "gguf" or settings.tp_size > 1:
        on, reason = False, f"quantization={quantization}, tp_size={settings.tp_size}: the cost is only measured free for gguf at tp_size 1"
    elif (feature := cpu_bf16_feature()) != "avx512_bf16":
        cost = "measured +18% a 16-row decode step on an AVX2 Zen 1, item 33" if feature is None else "not measured since item 24"
        on, reason = False, f"{feature or 'no native bf16'}: its cost is only measured free with AVX512-BF16 tiles ({cost})"
    else:
        on, reason = True, "gguf on AVX512-BF16 tiles: no measured cost (bench/RESULTS.md item 25)"
    log.info("enable_deterministic_inference auto resolved", enabled=on, reason=reason)
    return dataclasses.replace(settings, enable_deterministic_inference=on)


def resolve_cpu_threads(setting: int | None, ranks_per_node: int) -> int:
    """torch intra-op threads: the setting, else the cores this process may run on (its
    affinity mask, which taskset, numactl or a container's cpuset narrow; os.cpu_count()
    would count the whole machine), split between the node's tensor-parallel ranks."""
    if setting:
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks_per_node)


def _cpu_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 << 30


def resolve_settings(settings: EngineSettings, device: str, config: ModelConfig, kv_heads: int) -> EngineSettings:
    """Fill every auto knob with a number. On CUDA this runs with the weights resident.
    `kv_heads` is what this rank's KV pool holds (all of them below tp_size 2)."""
    per_token = KVPool.bytes_per_token(config.num_layers, kv_heads, config.head_dim, config.kv_dtype)
    if device == "cuda":
        # Memory an earlier engine of this process freed may still sit in unreachable
        # cycles or in torch's caching allocator, where mem_get_info counts it as used.
        gc.collect()
        torch.cuda.empty_cache()
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
