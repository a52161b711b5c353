"""Llama (and Mistral, Qwen2/Qwen3 via subclasses) over the packed token layout.

Module names mirror the HF checkpoint (`model.layers.N.self_attn...`) except for
the two fused projections: `qkv_proj` (q|k|v rows) and `gate_up_proj` (gate|up
rows), filled shard by shard in `load_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.attention.base import AttentionBatch
from runtime.layers.activation import SiluAndMulMLP
from runtime.layers.attention import RadixAttention
from runtime.layers.layernorm import RMSNorm
from runtime.layers.linear import Linear, MergedLinear
from runtime.layers.rotary_embedding import RotaryEmbedding, apply_rotary, rope_parameters
from runtime.layers.vocab_embedding import VocabEmbedding

if TYPE_CHECKING:
    from runtime.model_config import ModelConfig

# checkpoint projection -> (fused module, shard index)
_STACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, *, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.attn = RadixAttention(layer_id, self.head_dim**-0.5)
        self.qkv_proj = MergedLinear(config.hidden_size, (self.q_size, self.kv_size, self.kv_size), bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        eps = config.hf_config.rms_norm_eps
        # Qwen3: per-head RMSNorm on q and k before rope.
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: AttentionBatch) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv_proj(h).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.attn(q, k, v, fb)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, **attn_flags: bool) -> None:
        super().__init__()
        hf = config.hf_config
        self.self_attn = LlamaAttention(config, layer_id, **attn_flags)
        self.mlp = SiluAndMulMLP(config.hidden_size, hf.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, fb: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # On entry `h` is the previous layer's MLP output not yet added to `residual`
        # (None before the first layer, where `h` is the embedding).
        if residual is None:
            residual = h
            h = self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, **attn_flags: bool) -> None:
        super().__init__()
        hf = config.hf_config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.context_len, rope_parameters(hf))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, **attn_flags) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: AttentionBatch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, fb)
        if residual is None:  # zero layers
            return self.norm(h)
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    """`forward` -> final hidden states `[T, hidden]`; `compute_logits` -> float32 logits."""

    # Architecture switches the Qwen subclasses flip; None = from `attention_bias`.
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        if getattr(hf, "mlp_bias", False):
            raise NotImplementedError("mlp_bias=True checkpoints are not supported")
        if getattr(hf, "use_sliding_window", False):
            raise NotImplementedError("sliding-window attention is not supported")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act={hf.hidden_act!r} is not supported (silu is)")
        attention_bias = bool(getattr(hf, "attention_bias", False))
        self.config = config
        self.model = LlamaModel(
            config,
            qkv_bias=attention_bias if self.qkv_bias is None else self.qkv_bias,
            o_bias=attention_bias if self.o_bias is None else self.o_bias,
            qk_norm=self.qk_norm,
        )
        self.lm_head = self.model.embed_tokens if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: AttentionBatch) -> torch.Tensor:
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.lm_head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named checkpoint tensors into the (fused) parameters, casting to
        their dtype/device. Raises if a parameter is left unfilled."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints store a copy; the embedding is the source
            module_path, _, param_name = name.rpartition(".")
            parent, _, proj = module_path.rpartition(".")
            if proj in _STACKED:
                fused, shard = _STACKED[proj]
                target = modules[f"{parent}.{fused}"]
                assert isinstance(target, MergedLinear)
                target.load_shard(param_name, shard, tensor)
                filled.add(f"{parent}.{fused}.{param_name}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint {tuple(tensor.shape)} != model {tuple(param.shape)}")
            param.data.copy_(tensor)
            filled.add(name)
        missing = [n for n in self._expected_names(params, modules) if n not in filled]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    @staticmethod
    def _expected_names(params: dict[str, nn.Parameter], modules: dict[str, nn.Module]) -> list[str]:
        names: list[str] = []
        for name in params:
            module_path, _, param_name = name.rpartition(".")
            module = modules[module_path]
            if isinstance(module, MergedLinear):
                names += [f"{name}#{i}" for i in range(len(module.shard_sizes))]
            else:
                names.append(name)
        return names


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral checkpoints are Llama checkpoints when the sliding window (if any)
    covers the whole context."""

    def __init__(self, config: ModelConfig) -> None:
        window = getattr(config.hf_config, "sliding_window", None)
        if window is not None and window < config.context_len:
            raise NotImplementedError(
                f"sliding_window={window} < context_len={config.context_len}: pass a context_length <= {window}"
            )
        super().__init__(config)
