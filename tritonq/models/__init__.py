"""config.json `model_type` -> model class, built as Cls(config, loader, dtype, device, max_seq_len=None)."""
from __future__ import annotations

from tritonq.models.deepseek_v2 import DeepseekV2ForCausalLM
from tritonq.models.deepseek_v3 import DeepseekV3ForCausalLM
from tritonq.models.falcon import FalconForCausalLM
from tritonq.models.gemma3 import Gemma3ForCausalLM, Gemma3ImageTextForCausalLM
from tritonq.models.glm4_moe import Glm4MoeForCausalLM
from tritonq.models.gpt_oss import GptOssForCausalLM
from tritonq.models.llama import LlamaForCausalLM, MistralForCausalLM
from tritonq.models.mpt import MptForCausalLM
from tritonq.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from tritonq.models.qwen3_5 import (Qwen3_5ForCausalLM, Qwen3_5ImageTextForCausalLM, Qwen3_5MoeForCausalLM,
                                    Qwen3_5MoeImageTextForCausalLM, Qwen3NextForCausalLM)
from tritonq.models.qwen_moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODELS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM,
          "qwen3": Qwen3ForCausalLM, "deepseek_v2": DeepseekV2ForCausalLM, "gpt_oss": GptOssForCausalLM,
          "falcon": FalconForCausalLM, "mpt": MptForCausalLM}
MODELS.update({"qwen3_moe": Qwen3MoeForCausalLM, "qwen2_moe": Qwen2MoeForCausalLM, "mixtral": MixtralForCausalLM,
               "deepseek_v3": DeepseekV3ForCausalLM, "glm4_moe": Glm4MoeForCausalLM,
               "gemma3_text": Gemma3ForCausalLM, "gemma3": Gemma3ImageTextForCausalLM})
MODELS.update({"qwen3_5_text": Qwen3_5ForCausalLM, "qwen3_5": Qwen3_5ImageTextForCausalLM,
               "qwen3_5_moe_text": Qwen3_5MoeForCausalLM, "qwen3_5_moe": Qwen3_5MoeImageTextForCausalLM,
               "qwen3_next": Qwen3NextForCausalLM})


def model_class(model_type: str):
    """The model class for a config's model_type, or a ValueError listing the supported ones."""
    if model_type not in MODELS:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(MODELS)}.")
    return MODELS[model_type]
