"""Qwen2 and Qwen3 (dense): the Llama decoder of tritonq.models.llama with these differences, each a
LlamaVariant field:

  Qwen2  q, k, v projections always carry biases, o_proj and the MLP never (its config has no
         attention_bias / mlp_bias).
  Qwen3  attention_bias puts biases on q, k, v and o (as Llama's); an RMSNorm over each q and k head
         (self_attn.q_norm / k_norm, [head_dim], eps rms_norm_eps) before rope; the MLP has no bias.
  both   optional sliding window: the layers whose config.layer_types entry is "sliding_attention".
         transformers (5.x) derives layer_types when the config has none: sliding_window is kept only
         with use_sliding_window, and then layers i >= max_window_layers slide; a checkpoint's own
         layer_types list wins. Everything else (rope, GQA, head_dim, tied embeddings) is Llama's.

Weights have Llama's names (model.layers.N.self_attn.q_proj, ...), so every format's loader reads
them unchanged.
"""
from __future__ import annotations

from tritonq.models.llama import LlamaForCausalLM, LlamaVariant, layer_windows, sliding_layers_from_layer_types


def _windows(config) -> tuple[int, ...]:
    return layer_windows(config, sliding_layers_from_layer_types(config))


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 (model_type qwen2); see the module docstring."""

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        return LlamaVariant(qkv_bias=True, windows=_windows(config))


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense (model_type qwen3); see the module docstring."""

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, qk_norm=True, windows=_windows(config))
