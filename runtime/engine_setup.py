"""Turns settings into a running stack: rank 0's shard (runtime/model_executor/shard.py),
the tensor-parallel workers beside it, the tokenizer and the scheduler's pools.
Everything here runs once, at Engine construction."""

from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from config.settings import EngineSettings
from runtime.distributed.launcher import TPGroup, init_method, local_ranks
from runtime.distributed.parallel_state import destroy_tensor_parallel
from runtime.mem.kv_pool import KVPool
from runtime.mem.pools import MemoryPools
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import prepare_model_dir
from runtime.model_executor.pooler import pooler_for, resolve_pooling
from runtime.model_executor.resolve import resolve_settings
from runtime.layers.linear import kv_heads_per_rank
from runtime.model_executor.shard import build_shard, check_tp_size
from runtime.model_executor.tp_channel import BatchChannel
from runtime.model_executor.worker import Worker
from runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = structlog.get_logger("sluice.engine")


@dataclass(slots=True)
class TensorParallel:
    """Rank 0's handle on its group: the workers of this node and the batch channel."""

    group: TPGroup
    channel: BatchChannel

    def close(self) -> None:
        self.group.stop_watching()
        if self.group.failure is None:
            try:
                self.channel.shutdown()
            except Exception as exc:  # noqa: BLE001 - a rank died while we were stopping
                log.warning("tensor-parallel shutdown broadcast failed", error=repr(exc))
        self.group.close()
        # A failed group may never answer again: tearing it down could block on it.
        destroy_tensor_parallel(abandon=self.group.failure is not None)


@dataclass(frozen=True, slots=True)
class EngineStack:
    """Everything an Engine runs on, built once from resolved settings."""

    settings: EngineSettings  # every auto knob resolved to a value
    model_config: ModelConfig
    tokenizer: PreTrainedTokenizerBase
    pools: MemoryPools
    worker: Worker
    model_dir: str
    tp: TensorParallel | None = None


def _pools(settings: EngineSettings, config: ModelConfig) -> MemoryPools:
    assert settings.max_total_tokens and settings.max_running_requests, "resolve_settings first"
    return MemoryPools.build(
        settings.max_running_requests,
        config.context_len,
        settings.max_total_tokens,
        settings.page_size,
        settings.disable_radix_cache,
        by_role=settings.enable_deterministic_inference,
    )


def build_stub(
    settings: EngineSettings, *, constant_token: int | None = None, tokenizer: PreTrainedTokenizerBase | None = None
) -> EngineStack:
    """The real scheduler, pools and tokenizer of `settings.model_path` (default: the
    embedded model) around a StubWorker: no weights, no KV tensors, deterministic
    tokens (see runtime/model_executor/stub_worker.py). For fast tests and benchmarks."""
    from runtime.model_executor.stub_worker import StubWorker

    model_dir = prepare_model_dir(settings.model_path, settings.load_format)
    config = ModelConfig.from_pretrained(model_dir, torch.float32, settings.context_length)
    settings = resolve_settings(dataclasses.replace(settings, device="cpu"), "cpu", config, config.num_kv_heads)
    settings = resolve_pooling(settings, model_dir)
    if tokenizer is None:  # reading it is most of this function's time: tests pass one in
        tokenizer = load_tokenizer(settings.tokenizer_path or model_dir)
    pools = _pools(settings, config)
    assert settings.max_total_tokens
    worker = StubWorker(
        pools.num_rows, config.context_len, settings.max_total_tokens + settings.page_size, config.vocab_size,
        constant_token=constant_token, pooler=pooler_for(settings),
    )
    return EngineStack(settings, config, tokenizer, pools, worker, str(model_dir))


def _start_workers(settings: EngineSettings) -> tuple[TPGroup, str]:
    method = init_method(settings)
    group = TPGroup(settings, method, [r for r in local_ranks(settings) if r != 0])
    group.start()
    return group, method


def build(settings: EngineSettings) -> EngineStack:
    """Load rank 0's shard (starting this node's other ranks first) and size the pools."""
    if settings.tp_size > 1:
        model_dir = prepare_model_dir(settings.model_path, settings.load_format)  # converts a GGUF once, here
        check_tp_size(ModelConfig.from_pretrained(model_dir, torch.float32, settings.context_length), settings.tp_size)
    group, method = _start_workers(settings) if settings.tp_size > 1 else (None, None)
    try:
        shard = build_shard(settings, 0, method)
    except BaseException as exc:
        if group is None:
            raise
        worker_failure = group.failure  # a worker that died first is the cause
        group.fail("rank 0 failed to start")
        group.close()
        destroy_tensor_parallel()
        if worker_failure is not None:
            raise RuntimeError(f"tensor-parallel start-up failed: {worker_failure}") from exc
        raise
    settings, config, runner = shard.settings, shard.config, shard.runner
    tokenizer = load_tokenizer(settings.tokenizer_path or shard.model_dir)
    pools = _pools(settings, config)
    tp = None
    if group is not None:
        tp = TensorParallel(group, BatchChannel())
        runner.tp_channel, runner.on_tp_failure = tp.channel, group.fail
        group.start_heartbeat(lambda: tp.channel.heartbeat_if_idle(settings.dist_timeout / 4))
    kv_heads = kv_heads_per_rank(config.num_kv_heads, settings.tp_size)
    log.info(
        "engine ready",
        model=str(shard.model_dir),
        device=settings.device,
        tp_size=settings.tp_size,
        dtype=str(config.dtype).removeprefix("torch."),
        max_total_num_tokens=pools.max_total_num_tokens,
        max_running_requests=settings.max_running_requests,
        chunked_prefill_size=settings.chunked_prefill_size,
        kv_cache_dtype=str(config.kv_dtype).removeprefix("torch."),
        kv_gib_per_rank=round(KVPool.bytes_per_token(config.num_layers, kv_heads, config.head_dim, config.kv_dtype) * pools.max_total_num_tokens / (1 << 30), 3),
    )
    return EngineStack(settings, config, tokenizer, pools, runner, str(shard.model_dir), tp)


def freeze_startup_heap(where: str) -> None:
    """Move every object alive now (torch, transformers, the model's modules: ~10^5-10^6
    of them) out of the cyclic GC's reach (`gc.freeze`, as vLLM does after start-up), for a
    process that keeps one engine or shard for its life. A full collection otherwise walks
    them all, stalling the event loop and every stream on it: over 1500 served requests, 4
    full collections took 715 ms, the longest 203 ms; frozen, 164 and 76 ms (bench/RESULTS.md
    item 36). Frozen objects are still freed by reference counting; only cycles among them stay."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("startup heap frozen", where=where, objects=gc.get_freeze_count(), ms=round(1e3 * (time.perf_counter() - start), 1))
