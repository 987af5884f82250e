"""Gemma 3 text models (model_type gemma3_text: Gemma 3 1B, and the language model of the larger ones).

The Llama decoder of tritonq.models.llama (its attention, paged cache and tensor parallel split) with Gemma's
differences:
  norms       RMSNorm scaling by (1 + weight): the stored weight is a zero-centred offset. Four per layer:
              x + post_attention_layernorm(attn(input_layernorm(x))), then
              x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x))); q_norm / k_norm per head before rope.
  layers      config.layer_types (transformers derives it from sliding_window_pattern, 5 sliding : 1 full): sliding
              layers attend within sliding_window, full ones to everything.
  rope        one table per layer type: config.rope_parameters["sliding_attention"] (rope_local_base_freq, no
              scaling) and ["full_attention"] (rope_theta with its scaling, linear x8 in the 4B-27B checkpoints).
  attention   scale query_pre_attn_scalar ** -0.5 (not head_dim's); biases on q, k, v, o when attention_bias.
  MLP         GeGLU: down(gelu_tanh(gate x) * up x).
  embedding   rows times sqrt(hidden_size) rounded to the compute dtype (as transformers scales them); the tied
              lm_head multiplies the unscaled table. final_logit_softcapping: logits = cap * tanh(logits / cap).
Refused, naming the key: attn_logit_softcapping (the attention kernels have no softcap; Gemma 3's checkpoints set
it null), use_bidirectional_attention (EmbeddingGemma, an encoder), another hidden_activation.
The (1 + weight) is computed in float32 and then rounded once to the compute dtype (transformers multiplies in
float32): exact in float32, one extra bf16 rounding of each norm weight in bf16.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tritonq.formats.layers import Linear, RMSNorm
from tritonq.models.common import MLP, RopeTables, StepContext, logit_rows, rope_parameters
from tritonq.models.llama import (LlamaAttention, LlamaForCausalLM, LlamaVariant, layer_windows,
                                  sliding_layers_from_layer_types)

LAYER_TYPES = ("full_attention", "sliding_attention")  # index = a layer's `sliding` flag


def gemma_norm(loader, name: str, size: int, eps: float) -> RMSNorm:
    """The RMSNorm of stored offset `<name>.weight` [size]: weight 1 + offset (see the module docstring)."""
    offset = loader.get_tensor(f"{name}.weight", shape=(size,))
    return RMSNorm((1.0 + offset.float()).to(offset.dtype), eps)


class LayerTypeRope:
    """Both layer types' cos / sin for a step: cos = (full, sliding), sin likewise; a layer takes [its sliding flag]."""

    def __init__(self, tables: tuple[RopeTables, RopeTables]):
        self.tables = tables

    def __call__(self, ctx: StepContext):
        (cos_full, sin_full), (cos_sliding, sin_sliding) = (table(ctx) for table in self.tables)
        return (cos_full, cos_sliding), (sin_full, sin_sliding)


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma's q / k norms, scale and the rope table of its layer type."""

    def __init__(self, config, loader, prefix: str, variant: LlamaVariant, window: int):
        super().__init__(config, loader, prefix, variant, window)
        self.q_norm = gemma_norm(loader, f"{prefix}.q_norm", self.head_dim, config.rms_norm_eps)
        self.k_norm = gemma_norm(loader, f"{prefix}.k_norm", self.head_dim, config.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.sliding = window > 0

    def forward(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        return super().forward(x, cos[self.sliding], sin[self.sliding], ctx, k_pages, v_pages)


class GeGLU(MLP):
    """Gemma's MLP: down(gelu_tanh(gate x) * up x), split over ranks as MLP; gate/up one plain GEMM (the fused
    epilogue is SwiGLU's)."""

    gate_up = Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Four norms around attention and MLP; see the module docstring."""

    def __init__(self, config, loader, prefix: str, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = gemma_norm(loader, f"{prefix}.input_layernorm", D, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = gemma_norm(loader, f"{prefix}.post_attention_layernorm", D, eps)
        self.pre_feedforward_layernorm = gemma_norm(loader, f"{prefix}.pre_feedforward_layernorm", D, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = gemma_norm(loader, f"{prefix}.post_feedforward_layernorm", D, eps)

    def forward(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx, k_pages, v_pages))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text (model_type gemma3_text); see the module docstring. prefix: where its tensors are stored."""
    tie_word_embeddings = True
    prefix = "model"

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None):
        for key, refused in (("attn_logit_softcapping", "attention logit softcapping is not implemented by the "
                              "attention kernels"), ("use_bidirectional_attention", "bidirectional attention is an "
                              "encoder's (EmbeddingGemma), not a causal LM's")):
            if getattr(config, key, None):
                raise ValueError(f"{key}={getattr(config, key)!r} is not supported: {refused}; expected null / false.")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation={act!r} is not supported; expected 'gelu_pytorch_tanh' (Gemma 3).")
        super().__init__(config, loader, dtype, device, max_seq_len=max_seq_len)
        # transformers: the rows times a tensor(sqrt(hidden)) cast to the table's dtype; that value as a float
        self.embed_scale = torch.tensor(math.sqrt(config.hidden_size)).to(dtype).item()
        self.softcap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias,
                            windows=layer_windows(config, sliding_layers_from_layer_types(config)))

    def build_layers(self, config, loader):
        variant = self.variant(config)
        for i in range(config.num_hidden_layers):
            prefix = f"{self.prefix}.layers.{i}"
            attn = Gemma3Attention(config, loader, f"{prefix}.self_attn", variant, variant.windows[i])
            mlp = GeGLU(loader, f"{prefix}.mlp", config.hidden_size, config.intermediate_size)
            yield Gemma3DecoderLayer(config, loader, prefix, attn, mlp)

    def build_norm(self, config, loader) -> RMSNorm:
        return gemma_norm(loader, f"{self.prefix}.norm", config.hidden_size, config.rms_norm_eps)

    def position_tables(self, config, max_seq_len: int | None, dtype: torch.dtype) -> LayerTypeRope:
        """One RopeTables per layer type, from config.rope_parameters[layer type]."""
        rope = rope_parameters(config)
        if not all(isinstance(rope.get(t), dict) for t in LAYER_TYPES):
            raise ValueError(f"rope_parameters={rope} has no entry for each of {LAYER_TYPES}; expected one dict per "
                             "layer type (transformers writes them from rope_theta / rope_local_base_freq / "
                             "rope_scaling)")
        length = max_seq_len or config.max_position_embeddings
        return LayerTypeRope(tuple(RopeTables(self.rope_dim(), rope[t]["rope_theta"], rope[t],
                                              config.max_position_embeddings, length, self.device, dtype)
                                   for t in LAYER_TYPES))

    @torch.inference_mode()
    def forward(self, ctx: StepContext, cache) -> torch.Tensor:
        """CausalLM.forward with the embedding scale and the final logit softcap."""
        cos, sin = self.rope(ctx)
        x = self.embed_tokens(ctx.input_ids) * self.embed_scale
        for layer, k_pages, v_pages in zip(self.layers, cache.k, cache.v):
            x = layer(x, cos, sin, ctx, k_pages, v_pages)
        logits = self.lm_head(self.norm(logit_rows(x, ctx)))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class Gemma3ImageTextForCausalLM(Gemma3ForCausalLM):
    """The language model of a Gemma 3 image-text checkpoint (model_type gemma3: 4B-27B as published): the same
    network, its tensors under language_model.model.*, its settings in config.text_config. The vision tower and
    the multimodal projector are left unread with one warning: prompts are text."""
    prefix = "language_model.model"
    embedding = "language_model.model.embed_tokens"

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None):
        vision = [name for name in loader.weights.names() if not name.startswith("language_model.")]
        if vision:
            loader.leave_unread(vision, "Gemma 3 vision tower and multimodal projector: tritonq runs the language "
                                        "model on text prompts")
        text = config.get_text_config()
        if getattr(text, "final_logit_softcapping", None):  # null in every published gemma3 checkpoint
            raise ValueError(f"text_config.final_logit_softcapping={text.final_logit_softcapping!r} in an image-text "
                             "checkpoint is not supported: transformers' Gemma3ForConditionalGeneration ignores it "
                             "and its Gemma3ForCausalLM applies it: the intended logits are ambiguous; expected null")
        super().__init__(text, loader, dtype, device, max_seq_len=max_seq_len)
