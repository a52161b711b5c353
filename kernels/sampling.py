"""Sampling kernels in plain torch: no host round-trip anywhere on the path."""

from __future__ import annotations

import torch


def filter_top_k_top_p(
    probs: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None
) -> torch.Tensor:
    """Zero out tokens outside each row's top-k and top-p nucleus. probs: [bs, V]."""
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
    if top_ks is not None:
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        k = torch.where(top_ks > 0, top_ks, probs.shape[-1])[:, None]
        sorted_p = sorted_p.masked_fill(ranks >= k, 0.0)
    if top_ps is not None:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = sorted_p.cumsum(dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before > top_ps[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_p)


def filter_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    threshold = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


def sample_no_sync(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """Exponential race: argmax(p / Exp(1)) draws from p without a host sync.

    Rows with their own generator (a per-request seed) draw from it, so a seeded
    request samples the same tokens whatever batch it shares.
    """
    q = torch.empty_like(probs).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return (probs / q).argmax(dim=-1)
