"""Llama-architecture decoder (Llama 1-3, Mistral-style GQA) built from typed weights.

forward(ctx: StepContext, cache: PagedKVCache) -> logits [R, V] (compute dtype), see
tritonq.models.common: the step's new tokens of all its sequences are packed into T rows; each
layer writes their K/V into the paged cache, then attends over each sequence's pages (prefill:
cached prefix + new tokens, varlen; decode: one token per sequence). The model never branches on
the weight format: every projection is a layers.Linear; q/k/v and gate/up are each one fused GEMM.

Llama-family variants (Mistral here; Qwen2 / Qwen3 in tritonq.models.qwen) are this model with a
LlamaVariant: each difference from Llama is one named field, read from the config by the class's
variant(config) and refused there when the config asks for something the model does not do.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tritonq.kernels.norm_rope import apply_rope
from tritonq.formats.layers import Linear, RMSNorm, RowParallelLinear
from tritonq.models.common import MLP, CausalLM, DecoderLayer, StepContext, paged_attention, rope_paged_attention

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LlamaVariant:
    """How a Llama-family architecture differs from Llama, one named field per difference.

    qkv_bias / o_bias / mlp_bias: biases on q,k,v / o_proj / gate,up,down (Llama: attention_bias covers
    q,k,v,o; Qwen2: q,k,v always, o never). qk_norm: an RMSNorm over each q and k head (weights
    self_attn.q_norm / k_norm [head_dim]) before rope (Qwen3). windows[i]: layer i's sliding window,
    0 for full attention (a key at position j is seen from position p iff p - j < window).
    sinks: a learned logit per query head (self_attn.sinks [H]) in every softmax denominator (gpt-oss).
    partial_rotary: rope rotates the first int(head_dim * partial_rotary) dims of each q / k head (half-split
    within them), the rest pass unrotated (GLM-4.5's 0.5)."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    windows: tuple[int, ...] = ()
    sinks: bool = False
    partial_rotary: float = 1.0


def layer_windows(config, sliding_layers: list[bool]) -> tuple[int, ...]:
    """Each layer's window: config.sliding_window where sliding_layers[i], else 0 (full attention)."""
    window = getattr(config, "sliding_window", None)
    if any(sliding_layers) and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_window={window!r} for sliding-attention layers; expected a positive int.")
    return tuple(window if sliding else 0 for sliding in sliding_layers)


def sliding_layers_from_layer_types(config) -> list[bool]:
    """config.layer_types (transformers fills it from use_sliding_window / max_window_layers in its
    config class, so a checkpoint's explicit list and the derived one are both honoured) as flags;
    any layer type other than full / sliding attention is refused."""
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    if len(types) != config.num_hidden_layers or set(types) - set(ATTENTION_LAYER_TYPES):
        raise ValueError(f"layer_types={types} is not supported: expected {config.num_hidden_layers} entries, each one "
                         f"of {ATTENTION_LAYER_TYPES}.")
    return [t == "sliding_attention" for t in types]


class LlamaAttention(nn.Module):
    """Holds this rank's heads: num_heads / world query heads and num_kv_heads / world KV heads, or,
    with fewer KV heads than ranks, the one KV head its query heads use (replicated)."""

    def __init__(self, config, loader, prefix: str, variant: LlamaVariant, window: int):
        super().__init__()
        heads, kv_heads, world = config.num_attention_heads, config.num_key_value_heads, loader.world
        if heads % world or (kv_heads % world and world % kv_heads):
            raise ValueError(f"{prefix}: num_attention_heads={heads} and num_key_value_heads={kv_heads} cannot be "
                             f"divided across tensor_parallel={world} ranks; the query heads must divide by it, and "
                             "the KV heads divide by it or it by them")
        self.num_heads, self.num_kv_heads = heads // world, max(kv_heads // world, 1)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        D, q_dim, kv_dim = config.hidden_size, heads * self.head_dim, kv_heads * self.head_dim
        # Column-parallel q, k, v (each sharded by heads, then fused); row-parallel o over this rank's heads.
        self.qkv_proj = Linear(loader.get_fused_linear([f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
                                                       bias=variant.qkv_bias, parallel="column",
                                                       parts=[None, kv_heads, kv_heads],
                                                       shapes=[(q_dim, D), (kv_dim, D), (kv_dim, D)]))
        self.o_proj = RowParallelLinear(loader.get_linear(f"{prefix}.o_proj", bias=variant.o_bias, parallel="row",
                                                          shape=(D, q_dim)), world)
        self.q_norm = self.k_norm = None
        if variant.qk_norm:  # one [head_dim] weight shared by all heads: replicated on every rank
            head = (self.head_dim,)
            self.q_norm = RMSNorm(loader.get_tensor(f"{prefix}.q_norm.weight", shape=head), config.rms_norm_eps)
            self.k_norm = RMSNorm(loader.get_tensor(f"{prefix}.k_norm.weight", shape=head), config.rms_norm_eps)
        self.rotary_dim = int(self.head_dim * variant.partial_rotary)
        self.scale = self.head_dim ** -0.5
        self.window = window  # 0 = full attention
        self.sinks = None
        if variant.sinks:  # this rank's query heads' sinks, fp32 as the kernels take them
            self.sinks = loader.get_tensor(f"{prefix}.sinks", dim=0, shape=(heads,)).float().contiguous()

    def forward(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        """x [T, hidden] -> [T, hidden]; cos/sin [1, T, D] at the rows' positions."""
        return self.o_proj(self.attend(x, cos, sin, ctx, k_pages, v_pages))

    def attend(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        """forward before o_proj: x [T, hidden] -> the heads' outputs [T, heads * head_dim] (DecoderLayer runs
        o_proj with the residual addition and the next norm in its epilogue, `Linear.add_norm`)."""
        T, H, H_kv = x.shape[0], self.num_heads, self.num_kv_heads
        if self.rotary_dim < self.head_dim:  # partial rotary (GLM-4.5): qk-norm and rope of the first dims here
            qkv = self.qkv_proj(x).view(1, T, H + 2 * H_kv, self.head_dim)
            qk = qkv[:, :, :H + H_kv]
            if self.q_norm is not None:  # per head, before rope
                qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
            rot = self.rotary_dim
            qk = torch.cat([apply_rope(qk[..., :rot].contiguous(), cos, sin), qk[..., rot:]], dim=-1)
            q, k = qk[0].split([H, H_kv], dim=1)  # q and k heads in one call
            out = paged_attention(q, k, qkv[0, :, H + H_kv:], ctx, k_pages, v_pages, self.scale, window=self.window,
                                  sinks=self.sinks)
        else:
            q, k, v = self.qkv_proj(x).view(T, H + 2 * H_kv, self.head_dim).split([H, H_kv, H_kv], dim=1)
            # qk-norm (per head, before rope), rope and the KV write: one launch on a GPU
            out = rope_paged_attention(q, k, v, cos, sin, ctx, k_pages, v_pages, self.scale, self.q_norm,
                                       self.k_norm, window=self.window, sinks=self.sinks)
        return out.reshape(T, H * self.head_dim)


class LlamaForCausalLM(CausalLM):
    """Built as LlamaForCausalLM(config, loader, dtype, device, max_seq_len=None); see the module docstring and
    tritonq.models.common.CausalLM (embedding, final norm model.norm, lm_head untied by default, tensor parallel)."""
    supports_compile = True  # a decode step reads no device value on the host (tritonq.engine.compiled)

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        """Llama: attention_bias (q, k, v, o), mlp_bias; no window (transformers' Llama has none)."""
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
                            windows=(0,) * config.num_hidden_layers)

    @classmethod
    def build_mlp(cls, config, loader, layer: int, variant: LlamaVariant) -> nn.Module | None:
        """Layer `layer`'s feed-forward block; None: the dense MLP (MoE variants return their expert block)."""
        return None

    def build_layers(self, config, loader, expert_parallel: bool = False):
        """expert_parallel: handed to build_mlp (only MoE variants, which set supports_expert_parallel, get it)."""
        variant = self.variant(config)
        moe_options = {"expert_parallel": True} if expert_parallel else {}  # dense variants take no such argument
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}"
            mlp = self.build_mlp(config, loader, i, variant, **moe_options)
            attn = LlamaAttention(config, loader, f"{prefix}.self_attn", variant, variant.windows[i])
            if mlp is None:
                if config.hidden_act != "silu":
                    raise ValueError(f"Llama MLP supports hidden_act='silu'; the config says {config.hidden_act!r}.")
                mlp = MLP(loader, f"{prefix}.mlp", config.hidden_size, config.intermediate_size, bias=variant.mlp_bias)
            yield DecoderLayer(config, loader, prefix, attn, mlp)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window on every layer when config.sliding_window is set (transformers'
    Mistral ignores layer_types) and no biases (its config has neither attention_bias nor mlp_bias)."""

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        sliding = getattr(config, "sliding_window", None) is not None
        return LlamaVariant(windows=layer_windows(config, [sliding] * config.num_hidden_layers))
