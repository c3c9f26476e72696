"""Architecture name -> model class."""

from __future__ import annotations

from kvrelay.models.deepseek_v4.model import DeepseekV4ForCausalLM
from kvrelay.models.llama import LlamaForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
}


def model_class(architecture: str):
    try:
        return MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}") from None
