"""config.json `model_type` -> model class, built as Cls(config, loader, dtype, device)."""
from __future__ import annotations

from tritonq.models.deepseek_v2 import DeepseekV2ForCausalLM
from tritonq.models.llama import LlamaForCausalLM

MODELS = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "deepseek_v2": DeepseekV2ForCausalLM}


def model_class(model_type: str):
    """The model class for a config's model_type, or a ValueError listing the supported ones."""
    if model_type not in MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(MODELS)}.")
    return MODELS[model_type]
