"""DeepSeek-V2 / V2-Lite: multi-head latent attention (MLA) and DeepSeekMoE.

Per layer: x -> rms -> MLA -> +x -> rms -> (dense MLP | routed experts + shared experts) -> +x.

MLA (H heads, nope/rope/v head dims Dn/Dr/Dv, latent rank R = kv_lora_rank):
  q      = q_proj(x) or q_b_proj(rms(q_a_proj(x)))          [T, H, Dn + Dr]
  latent, k_rope = split(kv_a_proj_with_mqa(x), [R, Dr])  -> latent = rms(latent)
  k_nope, v = split(kv_b_proj(latent), [Dn, Dv]) per head; k_rope is shared by all heads.
Rotary acts on the Dr part only. Checkpoints store it as interleaved pairs (x0, x1), (x2, x3)...
(transformers rotates them as complex numbers); we de-interleave q and k to the half-split
layout and use rotate-half, which is the same rotation with the dims permuted identically in
q and k, so q . k is unchanged.

Two attention modes (`attention_mode`), both over the paged cache of tritonq.models.common:
  "expanded": pages k [P, bs, H, Dn + Dr] and v [P, bs, H, Dv] per layer; the new tokens' K/V
              are expanded from the latent and written, then paged prefill / decode attention.
  "latent":   pages [latent | k_rope] [P, bs, 1, R + Dr] per layer (MQA with one kv head), v a
              view of their first R dims. Decode absorbs kv_b_proj: q_latent = q_nope @ W_uk (per
              head, [Dn] -> [R]), attention against the pages, then o = out @ W_uv^T ([R] -> [Dv]).
              Prefill (cheaper expanded for many query tokens) expands K/V of the whole context,
              cached prefix included, from the latent pages into temporary pages.
DeepSeek-V2-Lite in bf16 (`kv_bytes_per_token`): latent 31,104 B/token, expanded 276,480 (8.9x).

Tensor parallel (loader.world > 1, every rank runs forward on the same inputs): each rank holds H/world
heads: q_proj / q_b_proj and kv_b_proj column-parallel (whole heads), o_proj row-parallel; q_a_proj,
kv_a_proj_with_mqa and their norms are replicated (the latent is shared by all heads), so the latent cache
is whole on every rank and the expanded cache holds the rank's heads. Dense MLPs and shared experts are
split by intermediate size; routed experts by intermediate size too, or, with expert_parallel=True, whole
experts E/world per rank (every rank routes every token, runs its experts). A MoE layer all-reduces once
(routed + shared parts), an attention once (o_proj); embedding and lm_head are vocab-parallel.

Behaviour follows transformers' DeepseekV2 where it agrees with DeepSeek's original modeling
code; for the config fields transformers ignores we follow the original: moe_layer_freq (see
`_is_moe_layer`) and norm_topk_prob (see `deepseek_v2_routing`). Yarn's attention factor follows
transformers (the original differs only when just one of mscale / mscale_all_dim is set).
"""
from __future__ import annotations

import logging
import math
import torch
from torch import nn

from tritonq.kernels.attention import decode_attention, paged_prefill_attention, read_kv_rows, write_kv_slots
from tritonq.kernels.common import compute_capability
from tritonq.kernels.norm_rope import apply_rope
from tritonq.formats.layers import Linear, RMSNorm, RowParallelLinear
from tritonq.models.common import (MLP, CausalLM, DecoderLayer, KVLayout, PagedKVCache, StepContext, paged_attention,
                                   rope_parameters)
from tritonq.models.moe import MoERouting, SparseMoE

ATTENTION_MODES = ("expanded", "latent")
LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


def kv_bytes_per_token(config, attention_mode: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """KV-cache bytes one token costs across all layers in the given attention mode."""
    if attention_mode not in ATTENTION_MODES:
        raise ValueError(f"attention_mode={attention_mode!r}; expected one of {ATTENTION_MODES}")
    if attention_mode == "latent":
        per_layer = config.kv_lora_rank + config.qk_rope_head_dim
    else:
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        per_layer = config.num_attention_heads * (qk_head_dim + config.v_head_dim)
    element_size = torch.empty((), dtype=dtype).element_size()
    return per_layer * config.num_hidden_layers * element_size


def softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn with mscale_all_dim set
    (DeepSeek's long-context correction; the cos/sin carry the matching attention factor)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(config)
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        scale *= (0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0) ** 2 if factor > 1 else 1.0
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] pairs (x0, x1), (x2, x3)... -> half-split (x0, x2, ..., x1, x3, ...)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def deepseek_v2_routing(config) -> MoERouting:
    """Softmax scores; topk_method "greedy" (all experts) or "group_limited_greedy" (n_group / topk_group,
    a group scored by its best expert).

    norm_topk_prob follows DeepSeek's original code: with top_k > 1 the top-k weights are renormalized
    and routed_scaling_factor is then NOT applied; otherwise they are multiplied by routed_scaling_factor.
    (transformers 5 ignores norm_topk_prob and always scales.) DeepSeek-V2 configs were written for
    DeepSeek's own modeling code (their auto_map), which the published weights were trained and evaluated
    with; V2 and V2-Lite ship `false`, where both rules agree."""
    top_k = config.num_experts_per_tok
    if config.topk_method == "greedy":
        n_group, topk_group = 1, 1
    elif config.topk_method == "group_limited_greedy":
        n_group, topk_group = config.n_group, config.topk_group
    else:
        raise ValueError(f"DeepSeek-V2 topk_method={config.topk_method!r} is not supported; "
                         "expected 'greedy' or 'group_limited_greedy'")
    renormalize = bool(config.norm_topk_prob) and top_k > 1
    return MoERouting(top_k, "softmax", n_group, topk_group, renormalize,
                      1.0 if renormalize else config.routed_scaling_factor)


def deepseek_moe(config, loader, prefix: str, routing: MoERouting, expert_parallel: bool = False) -> SparseMoE:
    """DeepSeekMoE: n_routed_experts routed experts plus n_shared_experts always-on ones (one MLP of
    n_shared_experts * moe_intermediate_size)."""
    D, inter = config.hidden_size, config.moe_intermediate_size
    shared = MLP(loader, f"{prefix}.shared_experts", D, inter * config.n_shared_experts, reduce=False) \
        if config.n_shared_experts else None  # reduced with the routed experts, once
    return SparseMoE(loader, prefix, routing, config.n_routed_experts, D, inter, shared=shared,
                     expert_parallel=expert_parallel)


class MLAttention(nn.Module):
    """Multi-head latent attention for one layer; see the module docstring for the two modes."""

    def __init__(self, config, loader, prefix: str, attention_mode: str, scale: float, interleaved_rope: bool = True):
        super().__init__()
        self.interleaved_rope = interleaved_rope  # rope dims stored as pairs (x0, x1), (x2, x3)... (see above)
        heads, world = config.num_attention_heads, loader.world
        if heads % world:
            raise ValueError(f"{prefix}: num_attention_heads={heads} cannot be divided across tensor_parallel={world} "
                             "ranks (each holds whole heads); use a tensor_parallel that divides it")
        self.num_heads = heads // world  # this rank's heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.attention_mode, self.scale = attention_mode, scale
        bias = bool(config.attention_bias)
        D, R, Q = config.hidden_size, self.kv_lora_rank, config.q_lora_rank
        q_out = heads * (self.nope_dim + self.rope_dim)  # full sizes: the loader checks them, then slices heads
        # q_a_proj / kv_a_proj_with_mqa (and their norms) are replicated (never sharded) under tensor
        # parallelism: their outputs (the q and kv latents) feed every head.
        if Q is None:
            self.q_proj = Linear(loader.get_linear(f"{prefix}.q_proj", parallel="column", shape=(q_out, D)))
        else:
            self.q_a_proj = Linear(loader.get_linear(f"{prefix}.q_a_proj", bias=bias, shape=(Q, D)))
            self.q_a_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.q_a_layernorm.weight", shape=(Q,)), LORA_NORM_EPS)
            self.q_b_proj = Linear(loader.get_linear(f"{prefix}.q_b_proj", parallel="column", shape=(q_out, Q)))
        self.q_lora_rank = config.q_lora_rank
        self.kv_a_proj_with_mqa = Linear(loader.get_linear(f"{prefix}.kv_a_proj_with_mqa", bias=bias,
                                                           shape=(R + self.rope_dim, D)))
        self.kv_a_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.kv_a_layernorm.weight", shape=(R,)), LORA_NORM_EPS)
        kv_b = loader.get_linear(f"{prefix}.kv_b_proj", parallel="column",
                                 shape=(heads * (self.nope_dim + self.v_dim), R))
        self.kv_b_proj = Linear(kv_b)
        self.o_proj = RowParallelLinear(loader.get_linear(f"{prefix}.o_proj", bias=bias, parallel="row",
                                                          shape=(D, heads * self.v_dim)), world)
        if attention_mode == "latent":
            # Absorbed decode needs kv_b per head as plain matrices in the compute dtype (converted once here,
            # not in every step): W_uk [H, Dn, R], W_uv^T [H, R, Dv] (laid out for the output bmm).
            w = kv_b.dequantize(loader.dtype).view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
            self.w_uk = w[:, :self.nope_dim].contiguous()
            self.w_uv_t = w[:, self.nope_dim:].transpose(1, 2).contiguous()

    def _expand_context(self, pages: torch.Tensor, ctx: StepContext):
        """K [P', bs, H, Dn + Dr] and V [P', bs, H, Dv] pages of every context token of the step's sequences,
        expanded from the latent pages by kv_b_proj (as transformers computes them), and their block table:
        sequence b's positions 0..context_lens[b]-1 in consecutive new pages."""
        H, Dn, Dr, Dv, R = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank
        bs, B = pages.shape[1], ctx.context_lens.shape[0]
        lens = ctx.context_lens.long()
        n_pages = (lens + bs - 1) // bs
        first_page = torch.cumsum(n_pages, 0) - n_pages
        total, num_new = ctx.num_context_tokens, ctx.num_context_blocks  # host ints: no device read
        seq = torch.repeat_interleave(torch.arange(B, device=lens.device), lens, output_size=total)
        pos = torch.arange(total, device=lens.device) - (torch.cumsum(lens, 0) - lens)[seq]
        rows = read_kv_rows(pages, ctx.block_table[seq, pos // bs].long(), pos % bs, self.w_uk.dtype)[:, 0]  # [N, R + Dr]
        k_nope, v = self.kv_b_proj(rows[:, :R]).view(total, H, Dn + Dv).split([Dn, Dv], dim=-1)
        k = torch.cat([k_nope, rows[:, None, R:].expand(total, H, Dr)], dim=-1)
        k_ctx = torch.empty(num_new, bs, H, Dn + Dr, dtype=rows.dtype, device=pages.device)
        v_ctx = torch.empty(num_new, bs, H, Dv, dtype=rows.dtype, device=pages.device)
        write_kv_slots(k_ctx, v_ctx, k, v.contiguous(), first_page[seq] * bs + pos, check_values=False)
        width = ctx.block_table.shape[1]
        table = (first_page[:, None] + torch.arange(width, device=lens.device)).to(torch.int32)
        return k_ctx, v_ctx, table

    def forward(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        """x [T, D] -> [T, D]; cos/sin [1, T, Dr] at the rows' positions."""
        return self.o_proj(self.attend(x, cos, sin, ctx, k_pages, v_pages))

    def attend(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        """forward before o_proj: x [T, D] -> the heads' outputs [T, H * Dv] (see models.common.DecoderLayer)."""
        T = x.shape[0]
        H, Dn, Dr, Dv, R = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(T, H, Dn + Dr).split([Dn, Dr], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([R, Dr], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        if self.interleaved_rope:
            q_rope, k_rope = _deinterleave(q_rope), _deinterleave(k_rope)
        q_rope = apply_rope(q_rope[None], cos, sin)[0]
        k_rope = apply_rope(k_rope[None, :, None], cos, sin)[0]  # [T, 1, Dr]

        if self.attention_mode == "expanded":
            k_nope, v = self.kv_b_proj(latent).view(T, H, Dn + Dv).split([Dn, Dv], dim=-1)
            k = torch.cat([k_nope, k_rope.expand(T, H, Dr)], dim=-1)
            out = paged_attention(torch.cat([q_nope, q_rope], dim=-1), k, v.contiguous(), ctx, k_pages, v_pages,
                                  self.scale)
        else:  # latent: v_pages views k_pages[..., :R], so writing k stores the latent as the value too
            write_kv_slots(k_pages, v_pages, torch.cat([latent[:, None], k_rope], dim=-1), latent[:, None],
                           ctx.slot_mapping, check_values=False)
            if ctx.is_prefill:  # many queries: expand K/V of the whole context (cheaper than absorbing)
                k_ctx, v_ctx, table = self._expand_context(k_pages, ctx)
                out = paged_prefill_attention(torch.cat([q_nope, q_rope], dim=-1), k_ctx, v_ctx, ctx.cu_seqlens_q,
                                              ctx.context_lens, table, self.scale, check_values=False)
            else:  # one query per sequence: attend in the latent space, one shared kv head of width R + Dr
                # Per-head GEMMs in the compute dtype (fp32 accumulation on the tensor cores), heads as the batch.
                q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, R]
                out_latent = decode_attention(torch.cat([q_latent, q_rope], dim=-1), k_pages, v_pages,
                                              ctx.context_lens, ctx.block_table, self.scale)
                out = torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [T, H, Dv]
        return out.reshape(T, H * Dv)


def _is_moe_layer(config, layer: int) -> bool:
    """DeepSeek's rule; transformers 5 ignores moe_layer_freq (treats it as 1)."""
    return (config.n_routed_experts is not None and layer >= config.first_k_dense_replace
            and layer % getattr(config, "moe_layer_freq", 1) == 0)


def default_attention_mode(device: torch.device | str) -> str:
    """"latent" (8.9x less KV cache), but "expanded" on CUDA before sm_80: no latent decode tile fits a T4's
    64 KB of shared memory per block (its [16, 512] query and accumulator alone take 68 KB: tests/aot/test_fit.py)."""
    device = torch.device(device)
    cc = compute_capability(device) if device.type == "cuda" else None
    if cc is not None and cc < 80:
        logging.getLogger("tritonq").warning(
            "%s is sm_%d: DeepSeek runs its expanded attention (8.9x the KV cache of the latent one, whose "
            "decode tiles need more shared memory than sm_%d's 64 KB per block)", device, cc, cc)
        return "expanded"
    return "latent"


class DeepseekV2ForCausalLM(CausalLM):
    """Built as DeepseekV2ForCausalLM(config, loader, dtype, device, attention_mode=None), None meaning
    `default_attention_mode(device)`; expert_parallel: see the module docstring (tensor parallel only).

    forward(ctx: StepContext, cache: PagedKVCache) -> logits [R, V] (compute dtype), as in
    tritonq.models.common.CausalLM; kv_layout says what its cache pages hold per token (on this rank).
    """
    static_prefill = False  # the latent prefill expands ctx.num_context_tokens rows (a host int)
    supports_expert_parallel = True

    routing = staticmethod(deepseek_v2_routing)

    @staticmethod
    def interleaved_rope(config) -> bool:
        """V2 checkpoints always store the rope dims as interleaved pairs."""
        return True

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str,
                 attention_mode: str | None = None, max_seq_len: int | None = None, expert_parallel: bool = False):
        if attention_mode is None:
            attention_mode = default_attention_mode(device)
        if attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention_mode={attention_mode!r}; expected one of {ATTENTION_MODES}")
        super().__init__(config, loader, dtype, device, max_seq_len, attention_mode=attention_mode,
                         expert_parallel=expert_parallel)
        self.attention_mode = attention_mode

    def build_layers(self, config, loader, attention_mode: str, expert_parallel: bool):
        """MLA in every layer; DeepSeekMoE from first_k_dense_replace on (see `_is_moe_layer`), else a dense MLP."""
        scale = softmax_scale(config)
        routing, interleaved = self.routing(config), self.interleaved_rope(config)
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}"
            attn = MLAttention(config, loader, f"{prefix}.self_attn", attention_mode, scale, interleaved)
            mlp = (deepseek_moe(config, loader, f"{prefix}.mlp", routing, expert_parallel) if _is_moe_layer(config, i)
                   else MLP(loader, f"{prefix}.mlp", config.hidden_size, config.intermediate_size))
            yield DecoderLayer(config, loader, prefix, attn, mlp)

    def cache_layout(self) -> KVLayout:
        """latent: [latent | k_rope] in one kv head, v its first kv_lora_rank dims; expanded: this rank's heads."""
        config, attn = self.config, self.layers[0].self_attn
        if attn.attention_mode == "latent":
            return KVLayout(len(self.layers), 1, config.kv_lora_rank + config.qk_rope_head_dim, config.kv_lora_rank,
                            v_in_k=True)
        return KVLayout(len(self.layers), attn.num_heads, config.qk_nope_head_dim + config.qk_rope_head_dim,
                        config.v_head_dim)

    def rope_dim(self) -> int:
        """Rope rotates the qk_rope_head_dim part of each head only."""
        return self.config.qk_rope_head_dim

    def forward(self, ctx: StepContext, cache: PagedKVCache) -> torch.Tensor:
        """CausalLM.forward, after checking that the cache pages are this attention mode's."""
        layout = self.kv_layout
        if cache.k[0].shape[2:] != (layout.num_kv_heads, layout.d_qk):
            other = "expanded" if self.attention_mode == "latent" else "latent"
            raise ValueError(f"cache pages [..., {cache.k[0].shape[2]}, {cache.k[0].shape[3]}] do not match this "
                             f"model's {self.attention_mode!r} attention, whose pages are [..., {layout.num_kv_heads}, "
                             f"{layout.d_qk}] (pages of the {other!r} mode?); allocate them with model.kv_layout")
        return super().forward(ctx, cache)
