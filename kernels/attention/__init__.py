"""Attention backends: torch-native (any device) and FlashInfer (CUDA)."""

from __future__ import annotations

from typing import Any

from kernels.attention.base import AttentionBackend


def create_attention_backend(
    name: str, device: str, use_cpu_kernel: bool = True, deterministic: bool = False, **kwargs: Any
) -> AttentionBackend:
    """`name` is the resolved setting: "torch" or "flashinfer". `deterministic`: every
    token through the CPU kernel's batch-invariant per-query path (CPU only)."""
    if deterministic and (name != "torch" or device != "cpu"):
        raise ValueError("deterministic attention is implemented for the torch backend on CPU only")
    if name == "flashinfer":
        from kernels.attention.flashinfer_backend import FlashInferBackend  # CUDA-only import

        return FlashInferBackend(device=device, **kwargs)
    from kernels.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(use_cpu_kernel=use_cpu_kernel and device == "cpu", deterministic=deterministic)


__all__ = ["AttentionBackend", "create_attention_backend"]
