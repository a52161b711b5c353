"""A checkpoint's tokenizer, as AutoTokenizer loads it, without the model's config class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(path)`. Given no config, AutoTokenizer builds the model's
    own (LlamaConfig...) only to read `model_type` and `tokenizer_class`, its fallbacks when
    tokenizer_config.json names no class; importing that class costs a server ~1.5 s
    (runtime/model_config.py). A base PreTrainedConfig of the same config.json carries both."""
    from transformers import AutoTokenizer, PreTrainedConfig

    config_json = Path(path) / "config.json"
    if not config_json.is_file():  # a tokenizer-only directory: AutoTokenizer's own way
        return AutoTokenizer.from_pretrained(path)
    config = PreTrainedConfig.from_dict(json.loads(config_json.read_text()))
    config._name_or_path = str(path)
    return AutoTokenizer.from_pretrained(path, config=config)
