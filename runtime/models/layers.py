"""Layers shared by the decoder-only models: linear, embedding, RMSNorm, rotary, MLP.

Parameters are created with `torch.empty` (no init pass): models are built directly
on the target device in the target dtype, then filled by `load_weights` or by the
dummy initializer. Every layer takes the packed token layout `[T, ...]`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """`y = x @ weight.T + bias` with `weight: [out, in]` (the HF checkpoint layout)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class MergedLinear(Linear):
    """Several checkpoint projections of the same input stacked along the output dim.

    Output rows `[offsets[i], offsets[i] + sizes[i])` hold shard i (q|k|v or
    gate|up), so one matmul replaces several; `load_shard` fills one shard.
    """

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = shard_sizes
        self.shard_offsets = tuple(sum(shard_sizes[:i]) for i in range(len(shard_sizes)))

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        param = self.weight if param_name == "weight" else self.bias
        assert param is not None, f"checkpoint has a {param_name} this layer was built without"
        dst = param.data.narrow(0, self.shard_offsets[shard], self.shard_sizes[shard])
        if dst.shape != tensor.shape:
            raise ValueError(f"shard {shard} of {param_name}: checkpoint {tuple(tensor.shape)} != {tuple(dst.shape)}")
        dst.copy_(tensor)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """HF-exact RMSNorm: normalize in float32, cast back, then scale by `weight`.

    `forward(x, residual)` fuses the residual add: it returns `(norm(x + residual),
    x + residual)`, the residual stream staying in the model dtype as in HF.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class SiluAndMulMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, (intermediate_size, intermediate_size))
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """`{"rope_type", "rope_theta", ...scaling fields}` from a transformers 5 config
    (`rope_parameters`) or an older one (`rope_theta` + `rope_scaling`)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type dict
        params = params["full_attention"]
    if not isinstance(params, dict) or "rope_theta" not in params:
        scaling = getattr(hf_config, "rope_scaling", None) or {}
        params = {**scaling, "rope_theta": getattr(hf_config, "rope_theta", 10000.0)}
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Per-pair inverse frequencies `[head_dim // 2]` in float32, scaled per `rope_type`."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept,
        # the band between them interpolated smoothly.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(f"rope_type={kind!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF Llama/Qwen layout: pairs are (i, i + head_dim/2)).

    `cos_sin_cache[pos] = [cos(pos * f) | sin(pos * f)]`, float32 `[max_positions,
    head_dim]`, built on whatever device is current. It stays float32: never cast
    the model with `.to(dtype)`; build it in the target dtype instead.
    """

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, params)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the batch's positions: float32 `[T, 1, head_dim // 2]` each,
        computed once per forward and shared by every layer."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] -> rotated copy (in float32, cast back to x's dtype)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
