"""Tiny HF checkpoints (random weights, saved as safetensors with the default model's
tokenizer) for the tensor-parallel suites: the default SmolLM2 has 9 heads and 3 KV
heads, which no tp_size of 2 can split. HF transformers loads the same files as the
oracle, so sluice is checked against HF on exactly these weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_llama_checkpoint(path: Path, tokenizer: Any, *, num_kv_heads: int, seed: int = 0) -> Path:
    """A 2-layer Llama-3-shaped checkpoint: 4 query heads of 16, `num_kv_heads` KV heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # HF's init is tiny (std 0.02): widen it so greedy tokens vary
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
