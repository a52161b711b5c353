"""Attention backends and sampling kernels. CUDA-only modules import lazily."""
