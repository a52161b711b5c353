"""ModelConfig: the facts about a checkpoint the engine sizes itself and builds its model by.

Read straight from `config.json`, without transformers: importing a model's config class
(LlamaConfig, Qwen3Config...) pulls in transformers' activations, kernels hub and
torch.distributed.tensor, ~1.5 s of a server's ~9 s start, for a dozen numbers. The
keys a config.json may omit take the defaults of transformers' config class for that
`model_type` (`_DEFAULTS`); tests/test_model_config.py holds every field against
`AutoConfig` for minimal and full configs of each architecture served.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")

# transformers 5's defaults (models/<type>/configuration_<type>.py) for the keys read here.
_COMMON: dict[str, Any] = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "head_dim": None, "rope_theta": 10000.0, "eos_token_id": None,
}  # fmt: skip
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _COMMON | {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048, "eos_token_id": 2,
    },
    "mistral": _COMMON | {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32, "eos_token_id": 2,
        "sliding_window": 4096,
    },
    "qwen2": _COMMON | {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
        "use_sliding_window": False, "sliding_window": 4096,
    },
    "qwen3": _COMMON | {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
        "use_sliding_window": False, "sliding_window": 4096,
    },
}  # fmt: skip
# A config.json without `architectures` (transformers saves none for a config alone).
_CAUSAL_LM = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def rope_parameters(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`{"rope_type", "rope_theta", ...scaling fields}` from a config.json's keys: transformers
    5's `rope_parameters` (one dict, or one per layer type) or an older `rope_theta` +
    `rope_scaling`; the latter wins where both are present, as in transformers."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if "full_attention" in params:  # per-layer-type dict
        params = params["full_attention"]
    params = dict(params)
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    if params["rope_type"] in ("llama3", "yarn", "longrope"):  # the pretraining length, Phi-3's key first
        if "original_max_position_embeddings" in raw:
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        elif "max_position_embeddings" in raw:
            params.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
    return params


def _derived_context_len(raw: Mapping[str, Any]) -> int:
    for key in _CONTEXT_KEYS:
        value = raw.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def read_config_json(path: Path) -> dict[str, Any]:
    """config.json with transformers' defaults for its `model_type` filled in (raises if it is
    not an architecture sluice serves)."""
    raw = json.loads((path / "config.json").read_text())
    model_type = raw.get("model_type")
    if model_type not in _DEFAULTS:
        names = raw.get("architectures") or [model_type]
        raise ValueError(
            f"architecture {names[0]!r} (model_type {model_type!r}) is not supported; supported: {', '.join(sorted(_CAUSAL_LM.values()))}"
        )
    return _DEFAULTS[model_type] | raw  # an explicit null stays null, as in transformers


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # config.json's architectures[0], the registry key
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in Qwen3/Mistral configs; else hidden_size // num_heads
    vocab_size: int
    context_len: int  # max tokens per request (prompt + output); rope cache length
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool  # q/k/v/o biases, unless the model class fixes them (Qwen2)
    mlp_bias: bool
    # The attention window the checkpoint trained with, None for full attention (Qwen's
    # windows only when `use_sliding_window`); a model runs it only if it spans the context.
    sliding_window: int | None
    rope_parameters: dict[str, Any]  # rope_parameters(config.json): rope_type, rope_theta, scaling
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the KV cache's; the model dtype unless kv_cache_dtype says otherwise
    eos_token_ids: tuple[int, ...]  # config.json's then generation_config.json's, deduplicated
    tie_word_embeddings: bool

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype, context_length: int | None = None, kv_cache_dtype: str = "auto"
    ) -> ModelConfig:
        path = Path(path)
        cfg = read_config_json(path)
        architectures = cfg.get("architectures") or [_CAUSAL_LM[cfg["model_type"]]]

        derived = _derived_context_len(cfg)
        if context_length is not None and context_length > derived:
            raise ValueError(
                f"context_length={context_length} exceeds the model's {derived} positions ({path.name})"
            )

        eos = _as_ids(cfg["eos_token_id"])
        gen_path = path / "generation_config.json"
        if gen_path.is_file():
            eos += _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))

        num_heads = cfg["num_attention_heads"]
        # Llama has none (a stray key is ignored, as LlamaConfig does); Qwen's counts only when used.
        no_window = cfg["model_type"] == "llama" or not cfg.get("use_sliding_window", True)
        return cls(
            architecture=architectures[0],
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=cfg["num_key_value_heads"] or num_heads,
            head_dim=cfg["head_dim"] or cfg["hidden_size"] // num_heads,
            vocab_size=cfg["vocab_size"],
            context_len=context_length or derived,
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            hidden_act=cfg["hidden_act"],
            attention_bias=bool(cfg["attention_bias"]),
            mlp_bias=bool(cfg["mlp_bias"]),
            sliding_window=None if no_window else cfg.get("sliding_window"),
            rope_parameters=rope_parameters(cfg),
            dtype=dtype,
            kv_dtype=dtype if kv_cache_dtype == "auto" else getattr(torch, kv_cache_dtype),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        )
