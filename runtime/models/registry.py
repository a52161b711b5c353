"""One registry: `config.architectures[0]` -> the model class that runs it."""

from __future__ import annotations


from runtime.models.llama import LlamaForCausalLM, MistralForCausalLM
from runtime.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {supported}") from None
