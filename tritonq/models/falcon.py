"""Falcon (model_type falcon): the causal LM of tritonq.models.common with Falcon's layer.

Differences from Llama (transformers 5.25 modeling_falcon.py, checked by tests/models/test_falcon_mpt.py):
  * one fused `self_attention.query_key_value` weight, laid out in groups along N:
      new_decoder_architecture (Falcon-40B/180B, GQA): num_kv_heads groups of (heads / num_kv_heads queries,
                                   one key, one value);
      multi_query (Falcon-7B, MQA): one group of (num_attention_heads queries, one key, one value);
      neither (MHA):               num_attention_heads groups of (query, key, value).
  * LayerNorm with bias; GELU (erf) MLP dense_h_to_4h / dense_4h_to_h; `bias` on every linear or none.
  * parallel_attn: attention and MLP both read the normed input, out = x + attn + mlp, with one norm
    (input_layernorm) or, new_decoder_architecture with num_ln_in_parallel_attn 2 (its default), two
    (ln_attn, ln_mlp); else sequential with post_attention_layernorm.
  * rotary over whole heads (Llama's rotate-half rope, rope_parameters); alibi Falcon is refused.
Weights: transformer.word_embeddings, transformer.h.N.*, transformer.ln_f, lm_head (tied by default).

Tensor parallel: query_key_value is cut column-wise into whole groups (each rank: its KV heads with their
queries), dense and dense_4h_to_h row-wise; needs the groups to divide by the world size, so multi-query
Falcon (one group) runs on one rank only (refused otherwise).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonq.kernels.norm_rope import apply_rope
from tritonq.formats.layers import LayerNorm, Linear, RowParallelLinear
from tritonq.models.common import CausalLM, StepContext, paged_attention


def layer_norm(loader, prefix: str, size: int, eps: float, bias: bool = True) -> LayerNorm:
    """The LayerNorm `<prefix>.weight` [size] (and `<prefix>.bias` when bias)."""
    shape = (size,)
    return LayerNorm(loader.get_tensor(f"{prefix}.weight", shape=shape),
                     loader.get_tensor(f"{prefix}.bias", shape=shape) if bias else None, eps)


class FalconAttention(nn.Module):
    """This rank's groups of the fused QKV (see the module docstring): H query heads, Hkv KV heads."""

    def __init__(self, config, loader, prefix: str):
        super().__init__()
        heads, D, world = config.num_attention_heads, config.hidden_size, loader.world
        self.head_dim = D // heads
        if self.head_dim * heads != D:
            raise ValueError(f"{prefix}: hidden_size={D} is not a multiple of num_attention_heads={heads}")
        if config.new_decoder_architecture:
            kv_heads = config.num_kv_heads
            if heads % kv_heads:
                raise ValueError(f"{prefix}: num_attention_heads={heads} is not a multiple of num_kv_heads={kv_heads}")
            groups, per_group = kv_heads, heads // kv_heads + 2
        elif config.multi_query:
            kv_heads, groups, per_group = 1, 1, heads + 2
        else:
            kv_heads, groups, per_group = heads, heads, 3
        if groups % world:
            raise ValueError(f"{prefix}: Falcon's query_key_value holds {groups} head group(s), which cannot be split "
                             f"across tensor_parallel={world} ranks (each rank needs whole groups: a key, a value and "
                             "their queries); use a tensor_parallel that divides them (multi-query Falcon: 1)")
        self.grouped = config.new_decoder_architecture or config.multi_query  # else (q, k, v) per head
        self.groups, self.per_group = groups // world, per_group
        self.num_heads, self.num_kv_heads = heads // world, kv_heads // world
        self.query_key_value = Linear(loader.get_linear(f"{prefix}.query_key_value", bias=config.bias,
                                                        parallel="column", parts=groups,
                                                        shape=(groups * per_group * self.head_dim, D)))
        self.dense = RowParallelLinear(loader.get_linear(f"{prefix}.dense", bias=config.bias, parallel="row",
                                                         shape=(D, D)), world)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        T, H, H_kv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.query_key_value(x).view(T, self.groups, self.per_group, self.head_dim)
        if self.grouped:  # each group: its queries, then its key, then its value
            q, k, v = qkv[:, :, :-2].reshape(T, H, self.head_dim), qkv[:, :, -2], qkv[:, :, -1]
        else:
            q, k, v = qkv.unbind(2)
        q, k = apply_rope(torch.cat([q, k], dim=1)[None], cos, sin)[0].split([H, H_kv], dim=1)
        out = paged_attention(q, k, v.contiguous(), ctx, k_pages, v_pages, self.scale)
        return self.dense(out.reshape(T, H * self.head_dim))


class FalconMLP(nn.Module):
    def __init__(self, config, loader, prefix: str):
        super().__init__()
        D, inter = config.hidden_size, config.ffn_hidden_size
        if config.activation != "gelu":
            raise ValueError(f"Falcon activation={config.activation!r} is not supported (supported: 'gelu')")
        self.dense_h_to_4h = Linear(loader.get_linear(f"{prefix}.dense_h_to_4h", bias=config.bias, parallel="column",
                                                      shape=(inter, D)))
        self.dense_4h_to_h = RowParallelLinear(loader.get_linear(f"{prefix}.dense_4h_to_h", bias=config.bias,
                                                                 parallel="row", shape=(D, inter)), loader.world)

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config, loader, prefix: str):
        super().__init__()
        D, eps = config.hidden_size, config.layer_norm_epsilon
        self.parallel = bool(config.parallel_attn)
        two_norms = config.new_decoder_architecture and (config.num_ln_in_parallel_attn or 2) == 2
        if config.new_decoder_architecture and not self.parallel:
            raise ValueError(f"{prefix}: new_decoder_architecture with parallel_attn=false is not a Falcon layout "
                             "(transformers' layer would read ln_attn, which it does not build)")
        self.attn_norm = layer_norm(loader, f"{prefix}.{'ln_attn' if two_norms else 'input_layernorm'}", D, eps)
        self.mlp_norm = None  # parallel with one norm: the MLP reads the attention's normed input
        if two_norms:
            self.mlp_norm = layer_norm(loader, f"{prefix}.ln_mlp", D, eps)
        elif not self.parallel:
            self.mlp_norm = layer_norm(loader, f"{prefix}.post_attention_layernorm", D, eps)
        self.self_attn = FalconAttention(config, loader, f"{prefix}.self_attention")
        self.mlp = FalconMLP(config, loader, f"{prefix}.mlp")

    def forward(self, x, pending, cos, sin, ctx, k_pages, v_pages):
        """(x, pending) -> (x, None): the CausalLM skeleton's residual stream; Falcon adds each term itself."""
        normed = self.attn_norm(x)
        attn = self.self_attn(normed, cos, sin, ctx, k_pages, v_pages)
        if not self.parallel:
            x = x + attn
            return x + self.mlp(self.mlp_norm(x)), None
        return x + attn + self.mlp(normed if self.mlp_norm is None else self.mlp_norm(x)), None


class FalconForCausalLM(CausalLM):
    """Built as FalconForCausalLM(config, loader, dtype, device); see the module docstring and
    tritonq.models.common.CausalLM (the embedding transformer.word_embeddings, the final LayerNorm transformer.ln_f,
    lm_head tied by default)."""
    supports_compile = True
    embedding = "transformer.word_embeddings"
    tie_word_embeddings = True

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None):
        if config.alibi:
            raise ValueError("Falcon with alibi=true (Falcon-RW) is not supported; rotary Falcon models are")
        super().__init__(config, loader, dtype, device, max_seq_len)

    def build_layers(self, config, loader):
        return (FalconDecoderLayer(config, loader, f"transformer.h.{i}") for i in range(config.num_hidden_layers))

    def build_norm(self, config, loader) -> LayerNorm:
        return layer_norm(loader, "transformer.ln_f", config.hidden_size, config.layer_norm_epsilon)
