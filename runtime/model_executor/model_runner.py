"""ModelRunner: the worker. ModelWorkerBatch -> ForwardBatch -> model -> sampler.

Runs on the worker executor (one thread), so forwards execute strictly in launch
order. It owns the worker's copy of req_to_token and applies each batch's writes
before its forward; that ordering is what makes scheduler-side reuse of rows and
slots safe while a forward is in flight.

On CUDA the worker thread only launches: host inputs go up from pinned memory
with non_blocking copies, the forward runs on the runner's own stream, and the
sampled tokens come back by a non_blocking copy into pinned memory plus an event
that a second thread waits on. So the worker can launch batch N+1 while batch N
is still on the device; stream order keeps N+1 after N (its future token ids are
resolved on the device). On the host, HostPipeline orders when a step's result is
published (host_pipeline.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import structlog
import torch

from kernels.attention.base import AttentionBackend
from runtime.model_executor import prompt_logprobs
from runtime.model_executor.forward_batch import ForwardBatch
from runtime.model_executor.future_map import FutureMap
from runtime.model_executor.host_pipeline import HostPipeline
from runtime.mem.kv_pool import KVPool
from runtime.model_executor.sampler import SampleOutput, Sampler
from runtime.model_executor.worker import BatchResult, ForwardInputs, ModelWorkerBatch, write_req_to_token
from runtime.layers.batch_invariant import PromptRows, forward_prompt_rows
from runtime.models.cpu_path import bind_cpu_ops, make_batch_invariant

if TYPE_CHECKING:
    from kernels.cpu import CpuOps
    from runtime.model_executor.cuda_graph_runner import CudaGraphRunner
    from runtime.model_executor.pooler import Pooler
    from runtime.model_executor.tp_channel import BatchChannel

log = structlog.get_logger("sluice.engine")


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        attn_backend: AttentionBackend,
        num_rows: int,
        context_len: int,
        vocab_size: int,
        device: torch.device | str,
        cpu_ops: CpuOps | None = None,
        deterministic: bool = False,
    ) -> None:
        """`cpu_ops`: the compiled CPU kernels, bound into the model's layers (fused norm,
        RoPE, SiLU·mul, Q8 LM head). `deterministic`: every row of every matmul
        independent of the batch (the attention backend must be built deterministic too)."""
        if cpu_ops is not None:
            log.info("CPU kernels bound into the model", layers=bind_cpu_ops(model, cpu_ops))
        if deterministic:
            make_batch_invariant(model)
        self.deterministic = deterministic
        self.model = model
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((num_rows, context_len), dtype=torch.int32, device=self.device)
        self.sampler = Sampler(num_rows, vocab_size, self.device, argmax_rows=cpu_ops.argmax_rows if cpu_ops is not None else None)
        self.futures: FutureMap | None = None
        self.graph_runner: CudaGraphRunner | None = None  # set by engine_setup on CUDA
        self.tp_channel: BatchChannel | None = None  # rank 0 of a tensor-parallel group
        self.on_tp_failure: Callable[[str], None] | None = None
        self.pooler: Pooler | None = None  # an --is-embedding server's (set by build_shard): no sampling
        self.stream: torch.cuda.Stream | None = None
        self._d2h: ThreadPoolExecutor | None = None
        self._host = HostPipeline(self)  # host steps: scheduler rounds run beside the kernels
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self._d2h = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-d2h")

    def close(self) -> None:
        if self._d2h is not None:
            self._d2h.shutdown(wait=False)

    def kv_buffers(self) -> list[torch.Tensor]:
        """K then V of every layer: [k0, v0, k1, v1, ...], each `[slots, kv_heads, head_dim]`."""
        return [buf for layer in zip(self.kv_pool.k_buffer, self.kv_pool.v_buffer) for buf in layer]

    def attach_future_map(self, futures: FutureMap) -> None:
        self.futures = futures
        if self.stream is not None:  # the last setup step: order the forward stream after it all
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _upload(self, values: list[int] | torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Host values -> device tensor without a host sync on CUDA (pinned + non_blocking;
        a pageable H2D copy would wait for the whole stream)."""
        t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _uses_graph(self, fb: ForwardBatch) -> bool:
        return self.graph_runner is not None and self.graph_runner.can_run(fb)

    def build_forward_batch(self, mwb: ModelWorkerBatch) -> ForwardBatch:
        assert self.futures is not None
        input_ids = self.futures.resolve(self._upload(mwb.input_ids))
        if self.tp_channel is not None:  # the other ranks run the same forward on their shards
            self.tp_channel.send(mwb, input_ids)
        return self.forward_batch_of(mwb, input_ids)

    def forward_batch_of(self, mwb: ForwardInputs, input_ids: torch.Tensor) -> ForwardBatch:
        """The ForwardBatch of `mwb` with its input ids resolved; writes the batch's
        req_to_token entries into this rank's copy first."""
        dev = self.device
        self.kv_pool.note_written(mwb.out_cache_loc)  # host slots (CPU pools map ahead of them)
        out_cache_loc = self._upload(mwb.out_cache_loc)
        write_req_to_token(self.req_to_token, mwb, out_cache_loc, self._upload)
        prefix = self._upload(mwb.extend_prefix_lens)
        ext = self._upload(mwb.extend_seq_lens)
        if mwb.forward_mode.is_decode():
            positions = prefix
        else:
            starts = torch.cumsum(ext, 0) - ext
            total = int(sum(mwb.extend_seq_lens))  # output_size: no device->host sync
            positions = torch.arange(total, device=dev) + torch.repeat_interleave(prefix - starts, ext, output_size=total)
        fb = ForwardBatch(
            forward_mode=mwb.forward_mode,
            batch_size=len(mwb.req_pool_indices),
            input_ids=input_ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            req_pool_indices=self._upload(mwb.req_pool_indices),
            seq_lens=self._upload(mwb.seq_lens),
            extend_prefix_lens=prefix,
            extend_seq_lens=ext,
            seq_lens_cpu=mwb.seq_lens,
            extend_prefix_lens_cpu=mwb.extend_prefix_lens,
            extend_seq_lens_cpu=mwb.extend_seq_lens,
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            prompt_logprob_rows=self._upload(mwb.prompt_logprob_rows) if mwb.prompt_logprob_rows else None,
        )
        if self.deterministic and mwb.role_switches and not mwb.forward_mode.is_decode():
            fb.prompt_rows = PromptRows.of(mwb.extend_prefix_lens, mwb.extend_seq_lens, mwb.role_switches)
        if not self._uses_graph(fb):  # a graph replay plans its own bucket
            self.attn_backend.init_forward_metadata(fb)
        return fb

    @torch.inference_mode()
    def forward_shard(self, inputs: ForwardInputs) -> None:
        """A non-zero tensor-parallel rank's step: the same forward on this rank's
        shard (its collectives pair with rank 0's); rank 0 samples."""
        fb = self.forward_batch_of(inputs, self._upload(inputs.input_ids))
        self.forward_logits(fb)
        if fb.prompt_hidden is not None:  # rank 0 computes prompt logprobs: join its all-gathers
            prompt_logprobs.compute(self.model.compute_logits, fb.prompt_hidden, None, 0)

    @torch.inference_mode()
    def forward_logits(self, fb: ForwardBatch) -> torch.Tensor:
        if self.graph_runner is not None and self._uses_graph(fb):
            return self.graph_runner.replay(fb)
        # An extend needs the final hidden states of its requests' last tokens only (and of
        # the rows it scores for prompt logprobs): the model's last layer runs just those.
        last_rows = None if fb.forward_mode.is_decode() else torch.cumsum(fb.extend_seq_lens, 0) - 1
        scored = last_rows is not None and fb.prompt_logprob_rows is not None
        with forward_prompt_rows(fb.prompt_rows):
            hidden = self.model(fb.input_ids, fb.positions, fb, None if scored else last_rows)
        if scored:
            fb.prompt_hidden = hidden[fb.prompt_logprob_rows]
            hidden = hidden[last_rows]
        return self.model.compute_logits(hidden)

    @contextlib.contextmanager
    def _tp_step(self) -> Iterator[None]:
        """A step on rank 0 of a tensor-parallel group: its send and collectives under one
        lock (never interleaved with another step's), a failure reported to the group."""
        if self.tp_channel is None:
            yield
            return
        with self.tp_channel.step_lock:
            try:
                yield
            except Exception as exc:
                if self.on_tp_failure is not None:
                    self.on_tp_failure(f"tensor-parallel forward failed: {exc}")
                raise

    def _forward(self, mwb: ModelWorkerBatch) -> SampleOutput:
        with self._tp_step():
            return self._forward_built(self.build_forward_batch(mwb), mwb)

    def run_step(self, fb: ForwardBatch, mwb: ModelWorkerBatch) -> BatchResult:
        """A host step after build_forward_batch (HostPipeline's second half)."""
        return self._to_result(self._forward_built(fb, mwb))

    def _forward_built(self, fb: ForwardBatch, mwb: ModelWorkerBatch) -> SampleOutput:
        logits = self.forward_logits(fb)
        sampling = mwb.sampling
        if self.device.type == "cuda":  # the sampler's .to(device) calls become no-ops
            up = lambda t: self._upload(t, t.dtype)  # noqa: E731
            sampling = dataclasses.replace(
                sampling, temperatures=up(sampling.temperatures), top_ps=up(sampling.top_ps), top_ks=up(sampling.top_ks),
                min_ps=up(sampling.min_ps), frequency=up(sampling.frequency), presence=up(sampling.presence),
                repetition=up(sampling.repetition), min_new_tokens=up(sampling.min_new_tokens),
            )  # fmt: skip
        out = self.sampler(logits, sampling, mwb.top_logprobs_nums)
        if fb.prompt_hidden is not None:
            targets = self._upload(mwb.prompt_logprob_targets)
            scored = prompt_logprobs.compute(self.model.compute_logits, fb.prompt_hidden, targets, mwb.prompt_top_k)
            assert scored is not None
            out = out._replace(prompt_logprobs=scored.logprobs, prompt_top_logprobs=scored.top_logprobs, prompt_top_ids=scored.top_ids)
        assert self.futures is not None
        self.futures.store(self._upload(mwb.future_ids), out.next_token_ids)
        return out

    @staticmethod
    def _to_result(out: SampleOutput) -> BatchResult:
        # The one host sync of a step (on CUDA: of the pinned copies, after their event).
        return BatchResult(
            next_token_ids=out.next_token_ids.tolist(),
            token_logprobs=None if out.token_logprobs is None else out.token_logprobs.tolist(),
            top_logprobs=None if out.top_logprobs is None else out.top_logprobs.tolist(),
            top_ids=None if out.top_ids is None else out.top_ids.tolist(),
            prompt_logprobs=None if out.prompt_logprobs is None else out.prompt_logprobs.tolist(),
            prompt_top_logprobs=None if out.prompt_top_logprobs is None else out.prompt_top_logprobs.tolist(),
            prompt_top_ids=None if out.prompt_top_ids is None else out.prompt_top_ids.tolist(),
        )

    @torch.inference_mode()
    def _launch_on_stream(self, mwb: ModelWorkerBatch) -> tuple[torch.cuda.Event, SampleOutput]:
        """Enqueue the forward, sampling and the copies back; returns without waiting."""
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            out = self._forward(mwb)
            host = SampleOutput(*(None if t is None else t.to("cpu", non_blocking=True) for t in out))  # pinned
            done = torch.cuda.Event()
            done.record(self.stream)
        return done, host

    @torch.inference_mode()
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> BatchResult:
        """Run one batch and wait for its tokens."""
        if self.stream is None:
            with self._tp_step():
                return self.run_step(self.build_forward_batch(mwb), mwb)
        done, host = self._launch_on_stream(mwb)
        done.synchronize()
        return self._to_result(host)

    def launch(self, executor: Executor, mwb: ModelWorkerBatch) -> Future[BatchResult]:
        """The scheduler's entry point. On CUDA the worker thread is free again once
        the batch is enqueued; the d2h thread completes the future when its copies land."""
        if self.pooler is not None:  # embedding server: pooled hidden states (pooler.py)
            return executor.submit(self.pooler.forward, self, mwb)
        if self.stream is None:  # the host: the worker thread runs the kernels itself
            if self.tp_channel is not None:  # one lock over a step's send and collectives
                return executor.submit(self.forward_batch_generation, mwb)
            return self._host.launch(executor, mwb)
        result: Future[BatchResult] = Future()
        d2h = self._d2h
        assert d2h is not None

        def finish(done: torch.cuda.Event, host: SampleOutput) -> None:
            try:
                done.synchronize()
                result.set_result(self._to_result(host))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting scheduler
                result.set_exception(e)

        def run() -> None:
            if not result.set_running_or_notify_cancel():  # the scheduler gave up on it
                return
            try:
                d2h.submit(finish, *self._launch_on_stream(mwb))
            except BaseException as e:  # noqa: BLE001
                result.set_exception(e)

        executor.submit(run)
        return result

