"""Qwen2 and Qwen3: the Llama decoder with two switches.

Qwen2: q/k/v projections carry a bias, o_proj does not.
Qwen3: per-head RMSNorm on q and k before rope (`q_norm`, `k_norm`), an explicit
`head_dim` that need not equal hidden_size / num_heads, biases per `attention_bias`.
"""

from __future__ import annotations

from runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
