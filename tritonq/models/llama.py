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
import torch.nn.functional as F
from torch import nn

from tritonq.kernels.attention import decode_attention, paged_prefill_attention, write_kv_slots
from tritonq.kernels.norm_rope import apply_rope
from tritonq.layers import Embedding, Linear, ParallelLMHead, RMSNorm, RowParallelLinear
from tritonq.models.common import KVLayout, PagedKVCache, RopeTables, StepContext, logit_rows
from tritonq.weights import DenseWeight

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def _rope_scaling(config) -> dict | None:
    """The rope dict whichever transformers version wrote the config (rope_parameters or rope_scaling)."""
    scaling = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return dict(scaling) if scaling else None


def rope_tables(config, head_dim: int, max_seq_len: int | None, device: torch.device, dtype: torch.dtype) -> RopeTables:
    """The cos/sin tables of a rotary model, sized for max_seq_len (default max_position_embeddings)."""
    scaling = _rope_scaling(config)
    theta = (scaling or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return RopeTables(head_dim, theta, scaling, config.max_position_embeddings,
                      max_seq_len or config.max_position_embeddings, device, dtype)


def vocab_parallel_head(loader, embedding: Embedding, config, table: tuple[int, int],
                        tie_default: bool) -> ParallelLMHead:
    """lm_head over this rank's vocabulary rows: the checkpoint's own (a quantized head on disk is always used),
    or, when tie_word_embeddings (default tie_default) holds and there is none, the embedding's table itself; then
    the embedding reads the head's tensor (one table: Linear may have re-laid it out for the CPU GEMV, and the
    lookup reads either layout). Untied without a head on disk is an error (loader.get_lm_head)."""
    head = loader.get_lm_head(bool(getattr(config, "tie_word_embeddings", tie_default)), table, parallel="column")
    lm_head = ParallelLMHead(DenseWeight(embedding.weight) if head is None else head, loader.world)
    if head is None:
        embedding.weight = lm_head.weight.weight
    return lm_head


@dataclass(frozen=True)
class LlamaVariant:
    """How a Llama-family architecture differs from Llama, one named field per difference.

    qkv_bias / o_bias / mlp_bias: biases on q,k,v / o_proj / gate,up,down (Llama: attention_bias covers
    q,k,v,o; Qwen2: q,k,v always, o never). qk_norm: an RMSNorm over each q and k head (weights
    self_attn.q_norm / k_norm [head_dim]) before rope (Qwen3). windows[i]: layer i's sliding window,
    0 for full attention (a key at position j is seen from position p iff p - j < window).
    sinks: a learned logit per query head (self_attn.sinks [H]) in every softmax denominator (gpt-oss)."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    windows: tuple[int, ...] = ()
    sinks: bool = False


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
        self.scale = self.head_dim ** -0.5
        self.window = window  # 0 = full attention
        self.sinks = None
        if variant.sinks:  # this rank's query heads' sinks, fp32 as the kernels take them
            self.sinks = loader.get_tensor(f"{prefix}.sinks", dim=0, shape=(heads,)).float().contiguous()

    def forward(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        """x [T, hidden] -> [T, hidden]; cos/sin [1, T, D] at the rows' positions."""
        T, H, H_kv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(1, T, H + 2 * H_kv, self.head_dim)
        qk = qkv[:, :, :H + H_kv]
        if self.q_norm is not None:  # per head, before rope
            qk = torch.cat([self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])], dim=2)
        q, k = apply_rope(qk, cos, sin)[0].split([H, H_kv], dim=1)  # q and k heads in one call
        v = qkv[0, :, H + H_kv:]
        # The step's values were checked once by the runner (see StepContext), not again in every layer.
        write_kv_slots(k_pages, v_pages, k, v, ctx.slot_mapping, check_values=False)
        if ctx.is_prefill:
            out = paged_prefill_attention(q, k_pages, v_pages, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_table,
                                          self.scale, window=self.window, check_values=False, sinks=self.sinks)
        else:  # one new token per sequence: rows are sequences
            out = decode_attention(q, k_pages, v_pages, ctx.context_lens, ctx.block_table, self.scale,
                                   window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(T, H * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config, loader, prefix: str, variant: LlamaVariant):
        super().__init__()
        bias = variant.mlp_bias
        D, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(loader.get_fused_linear([f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias=bias,
                                                           parallel="column", shapes=[(inter, D), (inter, D)]))
        self.down_proj = RowParallelLinear(loader.get_linear(f"{prefix}.down_proj", bias=bias, parallel="row",
                                                             shape=(D, inter)), loader.world)
        if config.hidden_act != "silu":
            raise ValueError(f"Llama MLP supports hidden_act='silu'; the config says {config.hidden_act!r}.")

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """mlp: the layer's feed-forward block (x [T, D] -> [T, D]); None: LlamaMLP at `<prefix>.mlp`."""

    def __init__(self, config, loader, prefix: str, variant: LlamaVariant, window: int, mlp: nn.Module | None = None):
        super().__init__()
        eps = config.rms_norm_eps
        D = (config.hidden_size,)
        self.input_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.input_layernorm.weight", shape=D), eps)
        self.self_attn = LlamaAttention(config, loader, f"{prefix}.self_attn", variant, window)
        self.post_attention_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.post_attention_layernorm.weight", shape=D),
                                                eps)
        self.mlp = LlamaMLP(config, loader, f"{prefix}.mlp", variant) if mlp is None else mlp

    def forward(self, x, cos, sin, ctx, k_pages, v_pages):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx, k_pages, v_pages)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Built as LlamaForCausalLM(config, loader, dtype, device); see the module docstring.

    Tensor parallel when loader.world > 1: every rank runs forward on the same inputs and gets the
    full logits; its KV cache holds only its KV heads (kv_layout is per rank).
    """
    supports_tensor_parallel = True
    supports_compile = True  # a decode step reads no device value on the host (tritonq.engine.compiled)

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        """Llama: attention_bias (q, k, v, o), mlp_bias; no window (transformers' Llama has none)."""
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
                            windows=(0,) * config.num_hidden_layers)

    @classmethod
    def build_mlp(cls, config, loader, layer: int, variant: LlamaVariant) -> nn.Module | None:
        """Layer `layer`'s feed-forward block; None: the dense LlamaMLP (MoE variants return their expert block)."""
        return None

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None,
                 expert_parallel: bool = False):
        """max_seq_len (default max_position_embeddings): the longest sequence the rope tables cover;
        expert_parallel: handed to build_mlp (only MoE variants, which set supports_expert_parallel, get it)."""
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        variant = self.variant(config)
        world = loader.world
        if config.vocab_size % world:
            raise ValueError(f"vocab_size={config.vocab_size} is not divisible by tensor_parallel={world}: the "
                             "embedding and lm_head are split by vocabulary rows; use a tensor_parallel that divides it")
        # Vocab-parallel: this rank's V/world rows of the embedding and of lm_head (tied: the same rows).
        table = (config.vocab_size, config.hidden_size)
        self.embed_tokens = Embedding(loader.get_embedding("model.embed_tokens", table, dim=0), loader.rank, world)
        moe_options = {"expert_parallel": True} if expert_parallel else {}  # dense variants take no such argument
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, loader, f"model.layers.{i}", variant, variant.windows[i],
                                                      self.build_mlp(config, loader, i, variant,
                                                                     **moe_options))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(loader.get_tensor("model.norm.weight", shape=table[1:]), config.rms_norm_eps)
        self.lm_head = vocab_parallel_head(loader, self.embed_tokens, config, table, tie_default=False)
        attn = self.layers[0].self_attn
        self.kv_layout = KVLayout(len(self.layers), attn.num_kv_heads, attn.head_dim, attn.head_dim)
        self.rope = rope_tables(config, attn.head_dim, max_seq_len, self.device, dtype)

    @torch.inference_mode()
    def forward(self, ctx: StepContext, cache: PagedKVCache) -> torch.Tensor:
        """Logits [R, V] at ctx.logit_rows (every row when None); writes the step's K/V into cache."""
        cos, sin = self.rope(ctx)  # gathered once for all layers
        x = self.embed_tokens(ctx.input_ids)
        for layer, k_pages, v_pages in zip(self.layers, cache.k, cache.v):
            x = layer(x, cos, sin, ctx, k_pages, v_pages)
        return self.lm_head(self.norm(logit_rows(x, ctx)))


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window on every layer when config.sliding_window is set (transformers'
    Mistral ignores layer_types) and no biases (its config has neither attention_bias nor mlp_bias)."""

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        sliding = getattr(config, "sliding_window", None) is not None
        return LlamaVariant(windows=layer_windows(config, [sliding] * config.num_hidden_layers))
