"""Rotary position embedding: inverse frequencies per rope type (the parameters come from
runtime.model_config.rope_parameters), the cos/sin cache, the rotation."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn


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


class RopeInputs(NamedTuple):
    """What every layer's rotation reads, computed once per forward."""

    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [T, 1, head_dim // 2] float32
    sin: torch.Tensor  # [T, 1, head_dim // 2] float32
    cos_sin_cache: torch.Tensor  # [max_positions, head_dim] float32, for the CPU kernel's in-place rotation


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF Llama/Qwen layout: pairs are (i, i + head_dim/2)).

    `cos_sin_cache[pos] = [cos(pos * f) | sin(pos * f)]`, float32 `[max_positions,
    head_dim]`, built on whatever device is current. It stays float32: never cast
    the model with `.to(dtype)`; build it in the target dtype instead.
    """

    cos_sin_cache: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, params)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(t.device))
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor) -> RopeInputs:
        """cos, sin for the batch's positions, computed once per forward and shared by every layer."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return RopeInputs(positions, cos, sin, self.cos_sin_cache)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] -> rotated copy (in float32, cast back to x's dtype)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
