"""The one settings schema: every knob, its default, its validation, its help line.

Names follow SGLang's `ServerArgs` so that `--chunked-prefill-size` means here what it
means there. `None` on an "auto" knob means "derive from the model and the machine";
`runtime.model_executor.resolve.resolve_settings` turns the autos into numbers once the model is loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_type_hints

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "priority")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
LOG_LEVELS = ("debug", "info", "warning", "error")


def knob(default: Any, help: str, **meta: Any) -> Any:
    """A settings field: one default and one help line, both required."""
    return field(default=default, metadata={"help": help, **meta})


class SettingsError(ValueError):
    """A knob was given a value outside its domain."""


@dataclass(frozen=True, slots=True)
class EngineSettings:
    # --- model ---
    model_path: str | None = knob(
        None, "HF model directory, .gguf file, or None for the embedded SmolLM2-135M-Instruct."
    )
    tokenizer_path: str | None = knob(None, "Tokenizer directory; defaults to the model's.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", "Weights/activations dtype. auto = float32 when quantization resolves to gguf, else "
        "bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else float32."
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = knob(
        "auto", "KV cache dtype. auto = the model dtype, except float16 under quantization=gguf on CPU "
        "(as llama.cpp). A 16-bit cache under a float32 model halves KV memory and the KV read of every "
        "decode step, at a small accuracy cost."
    )
    quantization: Literal["auto", "none", "int8", "int4", "gguf"] = knob(
        "auto", "Weight-only quantization of the linear layers (CPU only). int8: per output channel and "
        "int4: groups of 32, packed at load from the float weights; gguf: keep a GGUF file's own "
        "Q4_0/Q4_1/Q8_0 blocks, loaded straight into packed form (with dtype auto: float32 activations; "
        "on AVX512-VNNI CPUs Q4 layers multiply the blocks by 16-bit fixed-point activations in C++). "
        "auto = gguf for a GGUF model on CPU, else none. Embedding and LM head stay float "
        "(a float32 LM head that is exactly Q8_0 blocks, as a GGUF's, is read as those blocks by the CPU kernels)."
    )
    device: Literal["auto", "cpu", "cuda"] = knob("auto", "Where the model runs. auto = cuda if available.")
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = knob(
        "auto", "How to read weights. dummy = random weights of the configured shape (benchmarks)."
    )
    context_length: int | None = knob(None, "Max tokens per request (prompt + output). Default: the model's.")
    random_seed: int | None = knob(None, "Seed for dummy weights and for sampling without a per-request seed.")
    is_embedding: bool = knob(
        False, "Serve the model as an embedding model: /v1/embeddings and /encode answer, generation routes answer 400."
    )
    pooling: Literal["auto", "last", "mean", "cls"] = knob(
        "auto", "How an embedding server pools the final hidden states (then L2-normalizes). auto = the model "
        "dir's sentence-transformers 1_Pooling/config.json, else last (Qwen3-Embedding style)."
    )
    # --- memory ---
    max_running_requests: int | None = knob(None, "Rows of the request pool (max concurrently running requests).")
    max_total_tokens: int | None = knob(None, "KV pool size in tokens. Default on CPU: from a memory budget.")
    mem_fraction_static: float | None = knob(
        None, "Fraction of GPU memory for weights + KV pool (CUDA only). Default: from GPU memory, "
        "leaving room for the largest prefill's activations and the CUDA graphs (SGLang's rule)."
    )
    page_size: int = knob(1, "Tokens per KV page; the radix cache matches in whole pages.")
    disable_radix_cache: bool = knob(False, "Use a plain chunk cache: no prefix sharing between requests.")
    # --- scheduling ---
    chunked_prefill_size: int | None = knob(
        None, "Max prompt tokens prefilled per round (-1 disables chunking; None = auto)."
    )
    max_prefill_tokens: int = knob(16384, "Token budget of one prefill batch.")
    schedule_policy: Literal["fcfs", "lpm", "dfs-weight", "lof", "random", "priority"] = knob(
        "fcfs", "Order of the waiting queue. priority: by each request's `priority` field, then arrival."
    )
    schedule_low_priority_values_first: bool = knob(
        False, "With --schedule-policy priority: smaller `priority` values run first (by default larger ones do)."
    )
    enable_priority_preemption: bool = knob(
        False, "With --schedule-policy priority: a waiting request that lacks KV or a running slot retracts "
        "running requests of lower priority, which keep their output and re-prefill later."
    )
    priority_scheduling_preemption_threshold: int = knob(
        0, "Preemption needs the waiting request's priority to beat a running one's by more than this "
        "(0: any lower priority; SGLang's default is 10)."
    )
    abort_on_priority_when_disabled: bool = knob(
        False, "Refuse (400) requests that give a `priority` unless --schedule-policy is priority "
        "(by default such a priority is ignored)."
    )
    schedule_conservativeness: float = knob(
        1.0, "Scales the reserved decode budget (new_token_ratio); >1 admits fewer requests."
    )
    enable_mixed_chunk: bool = knob(False, "Let running decodes ride in prefill batches (ForwardMode.MIXED).")
    disable_overlap_schedule: bool = knob(False, "Run each forward inline instead of overlapping with scheduling.")
    stream_interval: int = knob(
        1, "A streamed request gets a chunk every this many output tokens (its first token and its last "
        "chunk at once): fewer, larger chunks cost the server less per token (bench/RESULTS.md item 39)."
    )
    enable_deterministic_inference: bool | None = knob(
        None, "Temperature-0 output (and seeded sampling) independent of batch composition: batch-invariant "
        "linear and attention (same reduction order for a row whatever the batch); sampling is per row. CPU "
        "with the compiled kernels only. Unset: on where it costs nothing measurable (quantization gguf on a "
        "CPU with AVX512-BF16 and no AMX), else off; the startup log says which. Float modes' matmuls run in "
        "16-row blocks. A token's KV depends on whether the model wrote it, so the radix cache shares an "
        "earlier answer only where the prompt marks it (the chat route marks assistant messages; /generate "
        "takes answer_spans); on a cold "
        "cache those tokens prefill on the decode kernel. Unseeded temperature > 0 stays batch-dependent."
    )
    # --- structured output ---
    grammar_backend: Literal["xgrammar", "none"] = knob(
        "xgrammar", "Constrained decoding for response_format / json_schema / regex / ebnf / forced tool calls. "
        "none refuses such requests."
    )
    # --- kernels ---
    attention_backend: Literal["auto", "torch", "flashinfer"] = knob(
        "auto", "Attention kernels. auto = flashinfer on CUDA, torch on CPU."
    )
    disable_cpu_kernels: bool = knob(
        False, "On CPU, run the pure-torch code instead of the compiled C++ kernels (paged decode attention, "
        "fused RMSNorm/RoPE/SiLU-mul/KV write, the Q8 LM head). enable_deterministic_inference needs them."
    )
    cuda_graph_max_bs: int | None = knob(None, "Largest decode batch captured in a CUDA graph (CUDA only).")
    disable_cuda_graph: bool = knob(False, "Run decode eagerly on CUDA.")
    # --- tensor parallelism (torch.distributed: gloo on CPU, NCCL on CUDA) ---
    tp_size: int = knob(1, "Tensor-parallel degree: the model is split across this many ranks (processes).")
    dist_init_addr: str | None = knob(
        None, "HOST:PORT where the tensor-parallel ranks rendezvous. Default: a free port on 127.0.0.1 (one node)."
    )
    nnodes: int = knob(1, "Nodes the tp_size ranks are spread over (tp_size / nnodes ranks per node).")
    node_rank: int = knob(0, "This node's index. Node 0 serves HTTP and runs rank 0; the others run workers only.")
    dist_timeout: float = knob(
        60.0, "Seconds a collective may wait for a rank before the group is declared dead (a hung or "
        "killed rank turns the server unhealthy and makes it exit non-zero). The ranks' rendezvous at "
        "start-up waits longer: up to max(dist_timeout, 600) s."
    )
    disable_custom_all_reduce: bool = knob(
        False, "On CPU, run the tensor-parallel collectives over gloo's sockets even where every rank is on "
        "this machine (by default they go through shared memory: microseconds instead of ~0.3-2 ms each)."
    )
    num_threads: int | None = knob(
        None, "torch intra-op threads on CPU. Default: the cores this process may run on (its CPU affinity), "
        "divided among the node's tensor-parallel ranks."
    )
    # --- prefill/decode disaggregation (a router pairs a prefill and a decode server) ---
    disaggregation_mode: Literal["null", "prefill", "decode"] = knob(
        "null", "null: one server prefills and decodes. prefill: compute prompts' KV and ship it to "
        "decode servers. decode: receive KV from prefill servers and decode."
    )
    disaggregation_bootstrap_port: int = knob(
        8998, "Prefill servers: port of the bootstrap server where decode servers find a request's KV sender."
    )
    disaggregation_transfer_backend: Literal["auto", "tcp", "gloo", "nccl", "fake"] = knob(
        "auto", "How KV moves between prefill and decode servers. tcp: the bootstrap connection itself; "
        "gloo/nccl: torch.distributed point-to-point; fake: no KV moves (warm-up, tests). auto = tcp on "
        "CPU, nccl on CUDA."
    )
    disaggregation_timeout: float = knob(
        60.0, "Seconds a request may wait for its peer's bootstrap or its KV transfer before it ends with an error."
    )
    # --- logging and tracing ---
    decode_log_interval: int = knob(40, "Log a 'Decode batch.' line every this many decode steps.")
    trace_buffer_size: int = knob(1000, "Finished requests whose per-request trace is kept (GET /v1/requests/{rid}/trace).")
    otlp_traces_endpoint: str | None = knob(
        None, "Export each request's trace as OpenTelemetry spans to this OTLP endpoint (e.g. http://localhost:4318/v1/traces)."
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True, slots=True)
class ServerSettings:
    host: str = knob("127.0.0.1", "Address to listen on.")
    port: int = knob(30000, "Port to listen on.")
    served_model_name: str | None = knob(None, "Model id reported by /v1/models. Default: from model_path.")
    api_key: str | None = knob(None, "Require 'Authorization: Bearer <key>' on every route but /health and /metrics.")
    max_queued_requests: int | None = knob(None, "Reject with 503 when this many requests wait. None = unbounded.")
    log_level: Literal["debug", "info", "warning", "error"] = knob("info", "Log level.")
    enable_metrics: bool = knob(True, "Expose Prometheus metrics on /metrics.")
    graceful_shutdown_timeout: float = knob(30.0, "Seconds SIGTERM waits for in-flight requests before exiting.")
    max_request_body_bytes: int = knob(8 * 1024 * 1024, "Larger request bodies get 413.")
    health_generate_timeout: float = knob(20.0, "Seconds /health_generate waits for one token.")

    def __post_init__(self) -> None:
        validate(self)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SettingsError(f"{name}={value!r}: must be one of {', '.join(choices)}")


def _check_min(name: str, value: float | None, lo: float, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if value is None or value < lo:
        raise SettingsError(f"{name}={value!r}: must be >= {lo}")


def _is_host_port(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def validate(s: EngineSettings | ServerSettings) -> None:
    hints = get_type_hints(type(s))
    for f in dataclasses.fields(s):
        value = getattr(s, f.name)
        choices = get_args(hints[f.name]) if getattr(hints[f.name], "__origin__", None) is Literal else ()
        if choices:
            _check_choice(f.name, value, choices)
    if isinstance(s, EngineSettings):
        for name in ("context_length", "max_running_requests", "max_total_tokens", "cuda_graph_max_bs", "num_threads"):
            _check_min(name, getattr(s, name), 1)
        _check_min("page_size", s.page_size, 1, allow_none=False)
        _check_min("max_prefill_tokens", s.max_prefill_tokens, 1, allow_none=False)
        _check_min("decode_log_interval", s.decode_log_interval, 1, allow_none=False)
        _check_min("stream_interval", s.stream_interval, 1, allow_none=False)
        _check_min("trace_buffer_size", s.trace_buffer_size, 0, allow_none=False)
        if s.chunked_prefill_size is not None and s.chunked_prefill_size != -1 and s.chunked_prefill_size < 1:
            raise SettingsError("chunked_prefill_size: must be -1 (off), None (auto) or >= 1")
        if s.chunked_prefill_size not in (None, -1) and s.chunked_prefill_size < s.page_size:
            raise SettingsError("chunked_prefill_size must be at least page_size")
        if s.mem_fraction_static is not None and not 0.0 < s.mem_fraction_static < 1.0:
            raise SettingsError(f"mem_fraction_static={s.mem_fraction_static}: must be in (0, 1)")
        if s.schedule_conservativeness <= 0:
            raise SettingsError("schedule_conservativeness: must be > 0")
        if s.enable_priority_preemption and s.schedule_policy != "priority":
            raise SettingsError("enable_priority_preemption needs schedule_policy=priority")
        _check_min("priority_scheduling_preemption_threshold", s.priority_scheduling_preemption_threshold, 0,
                   allow_none=False)
        _check_min("tp_size", s.tp_size, 1, allow_none=False)
        _check_min("nnodes", s.nnodes, 1, allow_none=False)
        _check_min("dist_timeout", s.dist_timeout, 1, allow_none=False)
        if s.tp_size % s.nnodes:
            raise SettingsError(f"tp_size={s.tp_size} must be a multiple of nnodes={s.nnodes}")
        if not 0 <= s.node_rank < s.nnodes:
            raise SettingsError(f"node_rank={s.node_rank}: must be in [0, nnodes={s.nnodes})")
        if s.nnodes > 1 and not s.dist_init_addr:
            raise SettingsError("nnodes > 1 needs dist_init_addr (HOST:PORT of node 0's rendezvous)")
        if s.dist_init_addr is not None and not _is_host_port(s.dist_init_addr):
            raise SettingsError(f"dist_init_addr={s.dist_init_addr!r}: must be HOST:PORT")
        if s.disaggregation_mode != "null" and not 0 < s.disaggregation_bootstrap_port < 65536:
            raise SettingsError(f"disaggregation_bootstrap_port={s.disaggregation_bootstrap_port}: must be in 1..65535")
        _check_min("disaggregation_timeout", s.disaggregation_timeout, 0.1, allow_none=False)
        if s.is_embedding and (s.tp_size > 1 or s.disaggregation_mode != "null"):
            raise SettingsError("is_embedding needs tp_size 1 and disaggregation_mode null (not supported together yet)")
        if s.device == "cpu" and s.attention_backend == "flashinfer":
            raise SettingsError("attention_backend=flashinfer needs device=cuda")
    else:
        if not 0 <= s.port <= 65535:
            raise SettingsError(f"port={s.port}: must be in 0..65535")
        _check_min("max_queued_requests", s.max_queued_requests, 1)
        _check_min("graceful_shutdown_timeout", s.graceful_shutdown_timeout, 0, allow_none=False)
        _check_min("max_request_body_bytes", s.max_request_body_bytes, 1024, allow_none=False)
        _check_min("health_generate_timeout", s.health_generate_timeout, 0.1, allow_none=False)


def settings_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, resolved type hint) pairs of a settings class, in declaration order."""
    hints = get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]
