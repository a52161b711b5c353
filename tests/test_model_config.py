"""ModelConfig reads config.json itself (runtime/model_config.py): every field it gives must be
what transformers' AutoConfig makes of the same file, for the keys a checkpoint sets and
for the defaults of those it leaves out; and neither it nor the tokenizer loader may pull
in the model's transformers config class at start-up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from runtime.model_config import ModelConfig, rope_parameters
from runtime.tokenizer import load_tokenizer

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
SMALL = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 96}

CONFIGS: dict[str, dict[str, Any]] = {
    # Nothing but the type: every field is transformers' default for it.
    "llama-bare": {"model_type": "llama"},
    "mistral-bare": {"model_type": "mistral"},
    "qwen2-bare": {"model_type": "qwen2"},
    "qwen3-bare": {"model_type": "qwen3"},
    # What checkpoints set: SmolLM2-like, with an eos list and tied embeddings.
    "llama-full": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **SMALL, "num_key_value_heads": 2,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "eos_token_id": [2, 7], "attention_bias": True, "mlp_bias": False, "hidden_act": "silu",
    },
    "llama-null-kv-heads": {"model_type": "llama", **SMALL, "num_key_value_heads": None, "head_dim": None},
    # Rope, three ways: an old `rope_scaling`, Llama 3.1's, transformers 5's `rope_parameters`.
    "llama-linear-rope": {"model_type": "llama", "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "llama3-rope": {"model_type": "llama", "rope_theta": 5e5, "max_position_embeddings": 4096, "rope_scaling": LLAMA3_SCALING},
    "llama-rope-parameters": {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    # Windows: Mistral's explicit null means full attention; Qwen's only counts when used.
    "mistral-null-window": {"model_type": "mistral", **SMALL, "sliding_window": None, "head_dim": 32},
    "mistral-window": {"model_type": "mistral", "sliding_window": 1024, "max_position_embeddings": 1024},
    "qwen2-window-unused": {"model_type": "qwen2", **SMALL, "sliding_window": 512, "use_sliding_window": False},
    "qwen2-window-used": {"model_type": "qwen2", **SMALL, "sliding_window": 512, "use_sliding_window": True},
    "qwen3-full": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **SMALL, "num_key_value_heads": 2, "head_dim": 32,
        "rope_theta": 1e6, "tie_word_embeddings": True, "eos_token_id": 151645, "max_position_embeddings": 40960,
    },
    # Shapes of released checkpoints' config.json, other keys as they ship them.
    "llama-3.1-like": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], **SMALL, "num_key_value_heads": 2,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "pretraining_tp": 1, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
        "rope_scaling": {**LLAMA3_SCALING, "original_max_position_embeddings": 8192},
    },
    "qwen2.5-like": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **SMALL, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "max_window_layers": 28, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": True, "eos_token_id": 151645,
    },
    "mistral-v0.3-like": {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], **SMALL, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": None, "eos_token_id": 2,
    },
}  # fmt: skip


def as_transformers_reads_it(path: Path) -> dict[str, Any]:
    """The fields ModelConfig gives, read from transformers' own config object."""
    hf = AutoConfig.from_pretrained(path)
    heads = hf.num_attention_heads
    window = getattr(hf, "sliding_window", None) if hf.model_type != "llama" else None
    eos = hf.eos_token_id
    rope = dict(hf.rope_parameters)
    return {
        "architecture": (getattr(hf, "architectures", None) or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf.model_type]])[0],
        "num_layers": hf.num_hidden_layers,
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_heads": heads,
        "num_kv_heads": hf.num_key_value_heads or heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        "vocab_size": hf.vocab_size,
        "context_len": hf.max_position_embeddings,
        "rms_norm_eps": hf.rms_norm_eps,
        "hidden_act": hf.hidden_act,
        "attention_bias": bool(getattr(hf, "attention_bias", False)),
        "mlp_bias": bool(getattr(hf, "mlp_bias", False)),
        "sliding_window": window if getattr(hf, "use_sliding_window", True) else None,
        "rope_parameters": rope,
        "eos_token_ids": tuple([] if eos is None else [eos] if isinstance(eos, int) else eos),
        "tie_word_embeddings": bool(hf.tie_word_embeddings),
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_json_reads_as_transformers_reads_it(name: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS[name]))
    ours = ModelConfig.from_pretrained(tmp_path, torch.float32)
    theirs = as_transformers_reads_it(tmp_path)
    assert {key: getattr(ours, key) for key in theirs} == theirs


def test_rope_parameters_from_old_and_new_keys() -> None:
    old = rope_parameters({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert old == {"type": "linear", "factor": 2.0, "rope_theta": 5e5, "rope_type": "linear"}
    per_layer_type = {"full_attention": {"rope_type": "default", "rope_theta": 1e6}}
    assert rope_parameters({"rope_parameters": per_layer_type}) == {"rope_type": "default", "rope_theta": 1e6}
    assert rope_parameters({}) == {"rope_type": "default", "rope_theta": 10000.0}


def test_an_architecture_sluice_does_not_serve_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*not supported; supported: LlamaForCausalLM"):
        ModelConfig.from_pretrained(tmp_path, torch.float32)


def test_tokenizer_loads_as_autotokenizer_loads_it(model_dir: Path) -> None:
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(theirs)
    text = "<|im_start|>user\nThe café's naïve résumé, 12 × 3<|im_end|>"
    assert ours(text).input_ids == theirs(text).input_ids
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id)


def test_start_up_reads_config_and_tokenizer_without_transformers_config_classes(model_dir: Path) -> None:
    """The model's transformers config module drags in torch.distributed.tensor and sympy
    (~1.5 s a server start); reading the config and the tokenizer needs none of them."""
    script = (
        "import sys, torch\n"
        "from runtime.model_config import ModelConfig\n"
        "from runtime.tokenizer import load_tokenizer\n"
        f"config = ModelConfig.from_pretrained({str(model_dir)!r}, torch.float32)\n"
        f"tok = load_tokenizer({str(model_dir)!r})\n"
        "assert tok('hello').input_ids and config.num_layers == 30\n"
        "heavy = ('transformers.models.llama.configuration_llama', 'torch.distributed.tensor', 'sympy')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
