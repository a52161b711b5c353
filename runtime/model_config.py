"""ModelConfig: the facts about a checkpoint the engine sizes itself by."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _derived_context_len(hf: PretrainedConfig) -> int:
    for key in _CONTEXT_KEYS:
        value = getattr(hf, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass(frozen=True, slots=True)
class ModelConfig:
    hf_config: PretrainedConfig
    architecture: str  # hf_config.architectures[0], the registry key
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in Qwen3/Mistral configs; else hidden_size // num_heads
    vocab_size: int
    context_len: int  # max tokens per request (prompt + output); rope cache length
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's; the model dtype unless kv_cache_dtype says otherwise
    eos_token_ids: tuple[int, ...]  # config.json's then generation_config.json's, deduplicated
    tie_word_embeddings: bool

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype, context_length: int | None = None, kv_cache_dtype: str = "auto"
    ) -> ModelConfig:
        path = Path(path)
        hf = AutoConfig.from_pretrained(path)
        architectures = getattr(hf, "architectures", None) or []
        if not architectures and hf.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf.model_type]]  # a bare config.json
        if not architectures:
            raise ValueError(f"{path / 'config.json'} names no `architectures`; cannot pick a model class")

        derived = _derived_context_len(hf)
        if context_length is not None and context_length > derived:
            raise ValueError(
                f"context_length={context_length} exceeds the model's {derived} positions ({path.name})"
            )

        eos = _as_ids(getattr(hf, "eos_token_id", None))
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            eos += _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))

        num_heads = hf.num_attention_heads
        return cls(
            hf_config=hf,
            architecture=architectures[0],
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // num_heads,
            vocab_size=hf.vocab_size,
            context_len=context_length or derived,
            dtype=dtype,
            kv_dtype=dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )
