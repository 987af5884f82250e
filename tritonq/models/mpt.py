"""MPT (model_type mpt): the paged decoder of tritonq.models.llama with MPT's layer and ALiBi instead of rope.

From transformers 5.25 modeling_mpt.py (checked by tests/models/test_falcon_mpt.py):
  * no position embedding: each head h adds slope_h * (key position) to its scores after the scale (ALiBi;
    slopes from alibi_bias_max 8 (others refused), by MPT's rule for any head count: kernels/attention.py's
    `alibi_slopes`, applied inside the paged prefill and decode kernels);
  * one fused `attn.Wqkv` [3 * d_model, d_model] (q, k, v each d_model), clamped to +-attn_config.clip_qkv when
    set; multi-head attention; scale attn_config.softmax_scale or 1 / sqrt(head_dim); `attn.out_proj`;
  * pre-norm blocks: norm_1 -> attention -> residual, norm_2 -> ffn (up_proj [expansion_ratio * d_model] (transformers:
    always 4), GELU (erf), down_proj) -> residual,
    LayerNorms without bias, final norm_f; no linear biases (no_bias); lm_head tied to wte by default.
Weights: transformer.wte, transformer.blocks.N.{norm_1, attn.Wqkv, attn.out_proj, norm_2, ffn.up_proj,
ffn.down_proj}, transformer.norm_f, lm_head. Refused: attn_config alibi false (learned positions), qk_ln,
prefix_lm, attn_uses_sequence_id, a multiquery attn_type (transformers' MPT runs none of them).

Not tensor parallel yet: Wqkv stores all q rows, then k, then v, so the loader's column cut is not per head
(reading it as three row blocks, each cut by heads, is the missing piece; AWQ/GPTQ packing allows it, N is
3 x d_model). The CPU step is not compiled (ALiBi's CPU attention runs eagerly).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonq.kernels.attention import alibi_slopes
from tritonq.layers import Embedding, Linear
from tritonq.models.common import KVLayout, PagedKVCache, StepContext, logit_rows
from tritonq.models.falcon import layer_norm, paged_attention
from tritonq.weights import DenseWeight

REFUSED_ATTN = {"qk_ln": False, "prefix_lm": False, "attn_uses_sequence_id": False}
ALIBI_BIAS_MAX = 8  # every MPT checkpoint's; transformers' MPT uses 8 whatever the config says


def attn_option(config, key: str, default=None):
    """attn_config[key] whether the config holds a dict or transformers' MptAttentionConfig."""
    attn = config.attn_config
    return attn.get(key, default) if isinstance(attn, dict) else getattr(attn, key, default)


class MptAttention(nn.Module):
    def __init__(self, config, loader, prefix: str):
        super().__init__()
        heads, D = config.n_heads, config.d_model
        if D % heads:
            raise ValueError(f"{prefix}: d_model={D} is not a multiple of n_heads={heads}")
        self.head_dim, self.num_heads = D // heads, heads
        self.Wqkv = Linear(loader.get_linear(f"{prefix}.Wqkv", shape=(3 * D, D)))  # rows: all q, then k, then v
        self.out_proj = Linear(loader.get_linear(f"{prefix}.out_proj", shape=(D, D)))
        self.clip_qkv = attn_option(config, "clip_qkv")
        self.scale = attn_option(config, "softmax_scale") or self.head_dim ** -0.5
        slopes = alibi_slopes(heads, ALIBI_BIAS_MAX)
        self.register_buffer("slopes", slopes.to(loader.device), persistent=False)

    def forward(self, x, ctx: StepContext, k_pages, v_pages):
        T, H = x.shape[0], self.num_heads
        qkv = self.Wqkv(x)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = qkv.view(T, 3, H, self.head_dim).unbind(1)
        out = paged_attention(q, k, v, ctx, k_pages, v_pages, self.scale, alibi_slopes=self.slopes)
        return self.out_proj(out.reshape(T, H * self.head_dim))


class MptBlock(nn.Module):
    def __init__(self, config, loader, prefix: str):
        super().__init__()
        D, eps, inter = config.d_model, config.layer_norm_epsilon, config.expansion_ratio * config.d_model
        self.norm_1 = layer_norm(loader, f"{prefix}.norm_1", D, eps, bias=False)
        self.attn = MptAttention(config, loader, f"{prefix}.attn")
        self.norm_2 = layer_norm(loader, f"{prefix}.norm_2", D, eps, bias=False)
        self.up_proj = Linear(loader.get_linear(f"{prefix}.ffn.up_proj", shape=(inter, D)))
        self.down_proj = Linear(loader.get_linear(f"{prefix}.ffn.down_proj", shape=(D, inter)))

    def forward(self, x, ctx, k_pages, v_pages):
        x = x + self.attn(self.norm_1(x), ctx, k_pages, v_pages)
        return x + self.down_proj(F.gelu(self.up_proj(self.norm_2(x))))


class MptForCausalLM(nn.Module):
    """Built as MptForCausalLM(config, loader, dtype, device); see the module docstring."""
    supports_tensor_parallel = False  # Wqkv stores all q rows, then k, then v: a column cut is not per head
    supports_compile = False  # the CPU ALiBi attention runs eagerly (kernels/cpu_attention.py)

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None):
        super().__init__()
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
        if loader.world > 1:
            raise ValueError(f"MPT does not support tensor_parallel={loader.world} yet (its fused Wqkv holds all query "
                             "rows, then all key rows, then all value rows); load it with tensor_parallel=1")
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.max_seq_len = max_seq_len or config.max_seq_len
        table = (config.vocab_size, config.d_model)
        self.wte = Embedding(loader.get_embedding("transformer.wte", table))
        self.blocks = nn.ModuleList(MptBlock(config, loader, f"transformer.blocks.{i}") for i in range(config.n_layers))
        self.norm_f = layer_norm(loader, "transformer.norm_f", config.d_model, config.layer_norm_epsilon, bias=False)
        head = loader.get_lm_head(bool(getattr(config, "tie_word_embeddings", True)), table)
        tied = head is None
        self.lm_head = Linear(DenseWeight(self.wte.weight) if tied else head)
        if tied:  # one table (see LlamaForCausalLM)
            self.wte.weight = self.lm_head.weight.weight
        attn = self.blocks[0].attn
        self.kv_layout = KVLayout(len(self.blocks), attn.num_heads, attn.head_dim, attn.head_dim)

    @torch.inference_mode()
    def forward(self, ctx: StepContext, cache: PagedKVCache) -> torch.Tensor:
        """Logits [R, V] at ctx.logit_rows (every row when None); writes the step's K/V into cache."""
        if ctx.max_position >= self.max_seq_len:  # a host int: no device read
            raise ValueError(f"position {ctx.max_position} is past max_seq_len={self.max_seq_len}; build the model "
                             "with a larger max_seq_len")
        x = self.wte(ctx.input_ids)
        for block, k_pages, v_pages in zip(self.blocks, cache.k, cache.v):
            x = block(x, ctx, k_pages, v_pages)
        return self.lm_head(self.norm_f(logit_rows(x, ctx)))
