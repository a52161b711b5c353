"""Llama (and Mistral, Qwen2/Qwen3 via subclasses) over the packed token layout.

Module names mirror the HF checkpoint (`model.layers.N.self_attn...`) except for
the two fused projections: `qkv_proj` (q|k|v rows) and `gate_up_proj` (gate|up
rows), filled shard by shard in `load_weights`.

Tensor parallelism (runtime/layers/linear.py): built on rank r of tp_size, the model
holds that rank's q and kv heads (so its KV pool holds only those kv heads), its
slice of the MLP intermediate and of the vocab; each decoder layer all-reduces twice
(o_proj, down_proj), the embedding once, and `compute_logits` all-gathers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.attention.base import AttentionBatch
from runtime.layers.activation import SiluAndMulMLP
from runtime.layers.attention import RadixAttention
from runtime.layers.batch_invariant import forward_prompt_rows, select_prompt_rows
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import QKVParallelLinear, RowParallelLinear
from runtime.layers.logits_processor import LogitsProcessor
from runtime.layers.rotary_embedding import RopeInputs, RotaryEmbedding, apply_rotary
from runtime.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.layers.weights import LazyWeight, Shape, ShardId, checkpoint_shapes_of, weight_loader_of

if TYPE_CHECKING:
    from kernels.cpu import CpuOps
    from runtime.model_config import ModelConfig

# checkpoint projection -> (fused module, shard id)
_STACKED: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNSTACKED: dict[tuple[str, ShardId], str] = {fused: proj for proj, fused in _STACKED.items()}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, *, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, qkv_bias)
        # This rank's heads: the attention backend and the KV pool see only these.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.attn = RadixAttention(layer_id, self.head_dim**-0.5)
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        eps = config.rms_norm_eps
        # Qwen3: per-head RMSNorm on q and k before rope (per head, so local to each rank).
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.ops: CpuOps | None = None  # set by runtime.models.cpu_path.bind_cpu_ops

    def forward(self, h: torch.Tensor, rope: RopeInputs, fb: AttentionBatch) -> torch.Tensor:
        return self.o_proj(self.attend(h, rope, fb))

    def attend(self, h: torch.Tensor, rope: RopeInputs, fb: AttentionBatch) -> torch.Tensor:
        """Everything before o_proj: `[T, q_size]` (the K and V of every row are written)."""
        t = h.shape[0]
        qkv = self.qkv_proj(h)
        fused_rope = self.ops is not None and self.q_norm is None  # Qwen3 norms q, k first
        if self.ops is not None and fused_rope:
            # q heads then k heads lead each row of qkv: rotated there in place, one pass.
            self.ops.rotary_(qkv, rope.positions, rope.cos_sin_cache, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not fused_rope:
            q, k = apply_rotary(q, rope.cos, rope.sin), apply_rotary(k, rope.cos, rope.sin)
        return self.attn(q, k, v, fb).reshape(t, self.q_size)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, **attn_flags: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, **attn_flags)
        self.mlp = SiluAndMulMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        fb: AttentionBatch,
        out_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # On entry `h` is the previous layer's MLP output not yet added to `residual`
        # (None before the first layer, where `h` is the embedding).
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        o = self.self_attn.attend(h, rope, fb)
        roles: AbstractContextManager[None] = nullcontext()
        if out_rows is not None:
            # Only `out_rows` go on past the attention (whose K and V cover every row): each
            # row of o_proj and the MLP is independent of the others, so they get the values
            # the whole batch would give them (row-invariant kernels: the same bits).
            o, residual = o.index_select(0, out_rows), residual.index_select(0, out_rows)
            roles = forward_prompt_rows(select_prompt_rows(out_rows))
        with roles:
            h, residual = self.post_attention_layernorm(self.self_attn.o_proj(o), residual)
            return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, **attn_flags: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.context_len, config.rope_parameters)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, **attn_flags) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The layers of a decode batch in one C++ call, or None (the module path) for a batch
        # it does not take; set by runtime.models.cpu_path.bind_cpu_ops.
        self.decode_stack: Callable[[torch.Tensor, torch.Tensor, AttentionBatch], torch.Tensor | None] | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: AttentionBatch, out_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The final hidden states of every row, or of rows `out_rows` only (`[len(out_rows),
        hidden]`): then the last layer runs o_proj and the MLP on those rows alone, as
        llama.cpp's graph does for the rows whose logits it needs (a prefill's last tokens)."""
        h = self.embed_tokens(input_ids)
        if self.decode_stack is not None and (out := self.decode_stack(h, positions, fb)) is not None:
            return out if out_rows is None else out.index_select(0, out_rows)
        rope = self.rotary_emb(positions)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope, fb, out_rows if i == last else None)
        if residual is None:  # zero layers
            h = self.norm(h)
            return h if out_rows is None else h.index_select(0, out_rows)
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    """`forward` -> final hidden states `[T, hidden]`; `compute_logits` -> float32 logits
    `[T, vocab]`, the whole vocab on every tensor-parallel rank."""

    # Architecture switches the Qwen subclasses flip; None = from `attention_bias`.
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.mlp_bias:
            raise NotImplementedError("mlp_bias=True checkpoints are not supported")
        window = config.sliding_window
        if window is not None and window < config.context_len:  # a window past the context is full attention
            raise NotImplementedError(
                f"sliding_window={window} < context_len={config.context_len}: pass a context_length <= {window}"
            )
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={config.hidden_act!r} is not supported (silu is)")
        attention_bias = config.attention_bias
        self.config = config
        self.model = LlamaModel(
            config,
            qkv_bias=attention_bias if self.qkv_bias is None else self.qkv_bias,
            o_bias=attention_bias if self.o_bias is None else self.o_bias,
            qk_norm=self.qk_norm,
        )
        self.lm_head: VocabParallelEmbedding = (
            self.model.embed_tokens if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size)
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: AttentionBatch, out_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(input_ids, positions, fb, out_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(hidden, self.lm_head)

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight]]) -> None:
        """Fill the parameters from HF-named checkpoint tensors: each parameter's
        weight_loader reads only this rank's part of a tensor, casting to the
        parameter's dtype/device. Raises if a checkpoint tensor is left unread."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for name, weight in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store a copy; the embedding is the source
            if not name.startswith(("model.", "lm_head.")):  # a base-model checkpoint (Qwen3-Embedding's)
                name = f"model.{name}"
            module_path, _, param_name = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            shard_id: ShardId = None
            param_path = name
            if proj in _STACKED:
                fused, shard_id = _STACKED[proj]
                param_path = f"{parent}.{fused}.{param_name}"
            if param_path not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[param_path]
            try:
                weight_loader_of(param)(param, weight, shard_id)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            filled.add(name)
        missing = [name for name, _, _ in self.checkpoint_tensors() if name not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    def checkpoint_tensors(self) -> Iterator[tuple[str, Shape, nn.Parameter]]:
        """Every checkpoint tensor `load_weights` needs: its HF name, its full
        (unsharded) shape, and the parameter it fills (a stacked one fills from several)."""
        for path, param in self.named_parameters():
            module_path, _, param_name = path.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            for shard_id, shape in checkpoint_shapes_of(param).items():
                proj = module if shard_id is None else _UNSTACKED[(module, shard_id)]
                yield ".".join(filter(None, (parent, proj, param_name))), shape, param


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral checkpoints are Llama checkpoints when the sliding window (if any)
    covers the whole context (checked in LlamaForCausalLM)."""
