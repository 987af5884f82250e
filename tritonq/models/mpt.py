"""MPT (model_type mpt): the causal LM of tritonq.models.common with MPT's layer and ALiBi instead of rope.

From transformers 5.25 modeling_mpt.py (checked by tests/models/test_falcon_mpt.py):
  * no position embedding: each head h adds slope_h * (key position) to its scores after the scale (ALiBi;
    slopes from alibi_bias_max 8 (others refused), by MPT's rule for any head count: kernels/attention/launch.py's
    `alibi_slopes`, applied inside the paged prefill and decode kernels);
  * one fused `attn.Wqkv` [3 * d_model, d_model] (q, k, v each d_model), clamped to +-attn_config.clip_qkv when
    set; multi-head attention; scale attn_config.softmax_scale or 1 / sqrt(head_dim); `attn.out_proj`;
  * pre-norm blocks: norm_1 -> attention -> residual, norm_2 -> ffn (up_proj [expansion_ratio * d_model] (transformers:
    always 4), GELU (erf), down_proj) -> residual,
    LayerNorms without bias, final norm_f; no linear biases (no_bias); lm_head tied to wte by default.
Weights: transformer.wte, transformer.blocks.N.{norm_1, attn.Wqkv, attn.out_proj, norm_2, ffn.up_proj,
ffn.down_proj}, transformer.norm_f, lm_head. Refused: attn_config alibi false (learned positions), qk_ln,
prefix_lm, attn_uses_sequence_id, a multiquery attn_type (transformers' MPT runs none of them).

Tensor parallel (tritonq.models.common.CausalLM: vocab-parallel wte and lm_head): each rank holds n_heads / world
heads. Wqkv stores all q rows, then all k, then all v, so it is read as three blocks each cut by heads (the
loader's `segments`; a contiguous cut of the fused rows would give one rank all of q); each rank's ALiBi slopes
are its heads' slopes; out_proj and ffn.down_proj are row-parallel, ffn.up_proj column-parallel. Quantized
checkpoints split as the format allows (AWQ: whole packs of 8 columns in each of q, k, v; refused otherwise,
naming the layer). The CPU step is not compiled (ALiBi's CPU attention runs eagerly).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonq.kernels.attention import alibi_slopes
from tritonq.formats.layers import Linear, RowParallelLinear
from tritonq.models.common import CausalLM, NoRope, StepContext, paged_attention
from tritonq.models.falcon import layer_norm

REFUSED_ATTN = {"qk_ln": False, "prefix_lm": False, "attn_uses_sequence_id": False}
ALIBI_BIAS_MAX = 8  # every MPT checkpoint's; transformers' MPT uses 8 whatever the config says


def attn_option(config, key: str, default=None):
    """attn_config[key] whether the config holds a dict or transformers' MptAttentionConfig."""
    attn = config.attn_config
    return attn.get(key, default) if isinstance(attn, dict) else getattr(attn, key, default)


class MptAttention(nn.Module):
    """This rank's n_heads / world heads (see the module docstring): x [T, d_model] -> [T, d_model] (this rank's
    partial sum of out_proj, all-reduced)."""

    def __init__(self, config, loader, prefix: str):
        super().__init__()
        heads, D, world = config.n_heads, config.d_model, loader.world
        if D % heads:
            raise ValueError(f"{prefix}: d_model={D} is not a multiple of n_heads={heads}")
        if heads % world:
            raise ValueError(f"{prefix}: n_heads={heads} cannot be divided across tensor_parallel={world} ranks "
                             "(each rank holds whole heads); use a tensor_parallel that divides it")
        self.head_dim = D // heads
        self.num_heads = self.num_kv_heads = heads // world  # multi-head: a key and a value per query head
        # rows: all q, then k, then v; each block cut by heads, so this rank's rows are its q, k, v heads in order
        self.Wqkv = Linear(loader.get_linear(f"{prefix}.Wqkv", parallel="column", segments=3, shape=(3 * D, D)))
        self.out_proj = RowParallelLinear(loader.get_linear(f"{prefix}.out_proj", parallel="row", shape=(D, D)), world)
        self.clip_qkv = attn_option(config, "clip_qkv")
        self.scale = attn_option(config, "softmax_scale") or self.head_dim ** -0.5
        first = loader.rank * self.num_heads
        slopes = alibi_slopes(heads, ALIBI_BIAS_MAX)[first:first + self.num_heads]  # this rank's heads' slopes
        self.register_buffer("slopes", slopes.contiguous().to(loader.device), persistent=False)

    def forward(self, x, ctx: StepContext, k_pages, v_pages):
        T, H = x.shape[0], self.num_heads
        qkv = self.Wqkv(x)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.view(T, 3, H, self.head_dim).unbind(1)
        out = paged_attention(q, k, v, ctx, k_pages, v_pages, self.scale, alibi_slopes=self.slopes)
        return self.out_proj(out.reshape(T, H * self.head_dim))


class MptBlock(nn.Module):
    """norm_1 -> attention -> residual, norm_2 -> GELU FFN (up_proj column-, down_proj row-parallel) -> residual."""

    def __init__(self, config, loader, prefix: str):
        super().__init__()
        D, eps, inter = config.d_model, config.layer_norm_epsilon, config.expansion_ratio * config.d_model
        self.norm_1 = layer_norm(loader, f"{prefix}.norm_1", D, eps, bias=False)
        self.self_attn = MptAttention(config, loader, f"{prefix}.attn")
        self.norm_2 = layer_norm(loader, f"{prefix}.norm_2", D, eps, bias=False)
        self.up_proj = Linear(loader.get_linear(f"{prefix}.ffn.up_proj", parallel="column", shape=(inter, D)))
        self.down_proj = RowParallelLinear(loader.get_linear(f"{prefix}.ffn.down_proj", parallel="row",
                                                             shape=(D, inter)), loader.world)

    def forward(self, x, pending, cos, sin, ctx, k_pages, v_pages):
        """(x, pending) -> (x, None): the CausalLM skeleton's residual stream, which MPT adds itself; cos, sin: None
        (ALiBi; the skeleton passes them to every layer)."""
        x = x + self.self_attn(self.norm_1(x), ctx, k_pages, v_pages)
        return x + self.down_proj(F.gelu(self.up_proj(self.norm_2(x)))), None


class MptForCausalLM(CausalLM):
    """Built as MptForCausalLM(config, loader, dtype, device); see the module docstring and
    tritonq.models.common.CausalLM (the embedding transformer.wte, the final LayerNorm transformer.norm_f, lm_head
    tied by default)."""
    supports_compile = False  # the CPU ALiBi attention runs eagerly (kernels/cpu/attention.py)
    embedding = "transformer.wte"
    tie_word_embeddings = True

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None):
        if not attn_option(config, "alibi", True):
            raise ValueError("MPT with attn_config.alibi=false (learned position embeddings) is not supported")
        for key, default in REFUSED_ATTN.items():
            if attn_option(config, key, default):
                raise ValueError(f"MPT attn_config.{key}={attn_option(config, key)!r} is not supported (transformers' "
                                 f"MPT does not run it either); expected {default!r}")
        if attn_option(config, "alibi_bias_max", ALIBI_BIAS_MAX) != ALIBI_BIAS_MAX:
            raise ValueError(f"MPT attn_config.alibi_bias_max={attn_option(config, 'alibi_bias_max')!r} is not supported "
                             f"(supported: {ALIBI_BIAS_MAX}): transformers' MPT ignores the key and uses 8, so there is "
                             "no reference for other slopes")
        if attn_option(config, "attn_type", "multihead_attention") != "multihead_attention":
            raise ValueError(f"MPT attn_config.attn_type={attn_option(config, 'attn_type')!r} is not supported "
                             "(supported: 'multihead_attention')")
        super().__init__(config, loader, dtype, device, max_seq_len or config.max_seq_len)

    def build_layers(self, config, loader):
        return (MptBlock(config, loader, f"transformer.blocks.{i}") for i in range(config.n_layers))

    def build_norm(self, config, loader) -> nn.Module:
        return layer_norm(loader, "transformer.norm_f", config.d_model, config.layer_norm_epsilon, bias=False)

    def position_tables(self, config, max_seq_len: int, dtype: torch.dtype) -> NoRope:
        """No rope: ALiBi's per-head bias is applied inside attention."""
        return NoRope(max_seq_len)
