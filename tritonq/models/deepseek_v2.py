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

Two attention modes (`attention_mode`):
  "expanded": cache k [B, Smax, H, Dn + Dr] and v [B, Smax, H, Dv] per layer;
              prefill and decode both through tritonq.kernels.attention.
  "latent":   cache [latent | k_rope] [B, Smax, 1, R + Dr] per layer (MQA with one kv head).
              Decode absorbs kv_b_proj: q_latent = q_nope @ W_uk (per head, [Dn] -> [R]), attention
              against the cache with v = its first R dims, then o = out @ W_uv^T ([R] -> [Dv]).
              Prefill expands K/V (cheaper for many query tokens) and writes the latent.
See `kv_bytes_per_token`.

Behaviour follows transformers' DeepseekV2 where the two agree; where transformers differs from
DeepSeek's original modeling code we follow the original for config fields transformers ignores
(moe_layer_freq, norm_topk_prob) — see `_is_moe_layer` and `DeepseekV2MoE`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tritonq.formats.base import DenseWeight, stack_experts
from tritonq.kernels.attention import decode_attention, prefill_attention, write_kv_cache
from tritonq.kernels.moe import fused_moe, grouped_topk
from tritonq.kernels.norm_rope import rms_norm
from tritonq.layers import Linear

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


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """cos, sin [max_positions, Dr] fp32 (half-split layout) and the softmax scale.

    Supports rope_type default and yarn (DeepSeek-V2's `rope_scaling`). The yarn formulas follow
    transformers' `_compute_yarn_parameters`: the cos/sin are scaled by the attention factor
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) and the softmax scale by
    mscale(factor, mscale_all_dim)^2.
    """
    params = config.rope_parameters
    dim, base = config.qk_rope_head_dim, params["rope_theta"]
    rope_type = params.get("rope_type", "default")
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    if rope_type == "default":
        inv_freq, attention_factor = 1.0 / pos_freqs, 1.0
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(params, dim, base, pos_freqs, config.max_position_embeddings)
        if params.get("mscale_all_dim"):
            scale *= yarn_get_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    else:
        raise ValueError(f"DeepSeek-V2 rope_type={rope_type!r} is not supported; expected 'default' or 'yarn'")
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor, scale


def _yarn(params, dim, base, pos_freqs, max_position_embeddings) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations):  # dimension whose wavelength makes `rotations` turns in `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp  # high-frequency dims keep their frequency, low ones are interpolated
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] pairs (x0, x1), (x2, x3)... -> half-split (x0, x2, ..., x1, x3, ...)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, h, Dr] half-split layout; cos/sin [B, S, Dr] fp32. Rotate-half convention."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos[:, :, None] + rotated * sin[:, :, None]).to(x.dtype)


@dataclass(frozen=True)
class MLACache:
    """Per-layer KV cache, preallocated. expanded: keys [B, Smax, H, Dn + Dr], values
    [B, Smax, H, Dv]; latent: keys [B, Smax, 1, R + Dr] and values = keys[..., :R] (a view:
    the latent is stored once and serves as both key prefix and value)."""
    attention_mode: str
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def max_seq_len(self) -> int:
        return self.keys[0].shape[1]


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate x) * up x), gate/up fused into one GEMM."""

    def __init__(self, loader, prefix: str):
        super().__init__()
        self.gate_up = Linear(loader.get_fused_linear([f"{prefix}.gate_proj", f"{prefix}.up_proj"]))
        self.down = Linear(loader.get_linear(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DeepseekV2MoE(nn.Module):
    """Routed experts (grouped top-k over a softmax router) plus always-on shared experts.

    norm_topk_prob follows DeepSeek's original code: with top_k > 1 the top-k weights are
    renormalized and routed_scaling_factor is then NOT applied; otherwise they are multiplied by
    routed_scaling_factor. (transformers 5 ignores norm_topk_prob and always scales.)
    """

    def __init__(self, config, loader, prefix: str):
        super().__init__()
        n_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        if config.topk_method == "greedy":
            self.n_group, self.topk_group = 1, 1
        elif config.topk_method == "group_limited_greedy":
            self.n_group, self.topk_group = config.n_group, config.topk_group
        else:
            raise ValueError(f"DeepSeek-V2 topk_method={config.topk_method!r} is not supported; "
                             "expected 'greedy' or 'group_limited_greedy'")
        self.renormalize = bool(config.norm_topk_prob) and self.top_k > 1
        self.routed_scaling_factor = 1.0 if self.renormalize else config.routed_scaling_factor
        # The router runs in fp32 (transformers keeps gate.weight in fp32 too).
        self.register_buffer("router", loader.get_tensor(f"{prefix}.gate.weight").float(), persistent=False)
        experts = [f"{prefix}.experts.{e}" for e in range(n_experts)]
        self.gate_up = stack_experts([loader.get_fused_linear([f"{p}.gate_proj", f"{p}.up_proj"]) for p in experts])
        self.down = loader.get_stacked([f"{p}.down_proj" for p in experts])
        self.shared = MLP(loader, f"{prefix}.shared_experts") if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = x.float() @ self.router.T
        topk_weights, topk_ids = grouped_topk(
            router_logits, self.top_k, n_group=self.n_group, topk_group=self.topk_group, scoring="softmax",
            renormalize=self.renormalize, routed_scaling_factor=self.routed_scaling_factor)
        out = fused_moe(x, self.gate_up, self.down, topk_weights, topk_ids)
        return out if self.shared is None else out + self.shared(x)


class MLAttention(nn.Module):
    """Multi-head latent attention for one layer; see the module docstring for the two modes."""

    def __init__(self, config, loader, prefix: str, attention_mode: str):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.attention_mode = attention_mode
        bias = bool(config.attention_bias)
        if config.q_lora_rank is None:
            self.q_proj = Linear(loader.get_linear(f"{prefix}.q_proj"))
        else:
            self.q_a_proj = Linear(loader.get_linear(f"{prefix}.q_a_proj", bias=bias))
            self.register_buffer("q_a_norm", loader.get_tensor(f"{prefix}.q_a_layernorm.weight"), persistent=False)
            self.q_b_proj = Linear(loader.get_linear(f"{prefix}.q_b_proj"))
        self.q_lora_rank = config.q_lora_rank
        self.kv_a_proj = Linear(loader.get_linear(f"{prefix}.kv_a_proj_with_mqa", bias=bias))
        self.register_buffer("kv_a_norm", loader.get_tensor(f"{prefix}.kv_a_layernorm.weight"), persistent=False)
        kv_b = loader.get_linear(f"{prefix}.kv_b_proj")
        self.kv_b_proj = Linear(kv_b)
        self.o_proj = Linear(loader.get_linear(f"{prefix}.o_proj", bias=bias))
        if attention_mode == "latent":
            # Absorbed decode needs kv_b per head as plain matrices: W_uk [H, Dn, R], W_uv [H, Dv, R].
            w = kv_b.dequantize().view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
            self.register_buffer("w_uk", w[:, :self.nope_dim].contiguous(), persistent=False)
            self.register_buffer("w_uv", w[:, self.nope_dim:].contiguous(), persistent=False)

    def forward(self, x, cos, sin, seq_lens, start, cache: MLACache, layer: int, scale: float, prefill: bool):
        """x [B, S, D]; cos/sin [B, S, Dr]; seq_lens/start [B] int32. Returns [B, S, D]."""
        B, S, D = x.shape
        H, Dn, Dr, Dv, R = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank
        x = x.view(B * S, D)  # the linear layers take [M, K]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(rms_norm(self.q_a_proj(x), self.q_a_norm, LORA_NORM_EPS))
        q_nope, q_rope = q.view(B, S, H, Dn + Dr).split([Dn, Dr], dim=-1)
        latent, k_rope = self.kv_a_proj(x).view(B, S, R + Dr).split([R, Dr], dim=-1)
        latent = rms_norm(latent, self.kv_a_norm, LORA_NORM_EPS)
        q_rope = _apply_rope(_deinterleave(q_rope), cos, sin)
        k_rope = _apply_rope(_deinterleave(k_rope).view(B, S, 1, Dr), cos, sin)
        k_cache, v_cache = cache.keys[layer], cache.values[layer]

        if self.attention_mode == "latent":
            write_kv_cache(k_cache, v_cache, torch.cat([latent[:, :, None], k_rope], dim=-1), latent[:, :, None], start)
        if prefill:
            k_nope, v = self.kv_b_proj(latent.reshape(B * S, R)).view(B, S, H, Dn + Dv).split([Dn, Dv], dim=-1)
            k = torch.cat([k_nope, k_rope.expand(B, S, H, Dr)], dim=-1)
            if self.attention_mode == "expanded":
                write_kv_cache(k_cache, v_cache, k, v, start)
            out = prefill_attention(torch.cat([q_nope, q_rope], dim=-1), k, v.contiguous(), seq_lens, scale)
        elif self.attention_mode == "expanded":
            k_nope, v = self.kv_b_proj(latent.reshape(B, R)).view(B, 1, H, Dn + Dv).split([Dn, Dv], dim=-1)
            write_kv_cache(k_cache, v_cache, torch.cat([k_nope, k_rope.expand(B, 1, H, Dr)], dim=-1),
                           v.contiguous(), start)
            out = decode_attention(torch.cat([q_nope, q_rope], dim=-1)[:, 0], k_cache, v_cache, start + 1, scale)
        else:
            q_latent = torch.einsum("bhn,hnr->bhr", q_nope[:, 0].float(), self.w_uk.float()).to(x.dtype)
            out_latent = decode_attention(torch.cat([q_latent, q_rope[:, 0]], dim=-1), k_cache, v_cache,
                                          start + 1, scale)
            out = torch.einsum("bhr,hvr->bhv", out_latent.float(), self.w_uv.float()).to(x.dtype)
        return self.o_proj(out.reshape(B * S, H * Dv)).view(B, S, D)


def _is_moe_layer(config, layer: int) -> bool:
    """DeepSeek's rule; transformers 5 ignores moe_layer_freq (treats it as 1)."""
    return (config.n_routed_experts is not None and layer >= config.first_k_dense_replace
            and layer % getattr(config, "moe_layer_freq", 1) == 0)


class DecoderLayer(nn.Module):
    def __init__(self, config, loader, layer: int, attention_mode: str):
        super().__init__()
        prefix = f"model.layers.{layer}"
        self.eps = config.rms_norm_eps
        self.register_buffer("input_norm", loader.get_tensor(f"{prefix}.input_layernorm.weight"), persistent=False)
        self.register_buffer("post_attention_norm", loader.get_tensor(f"{prefix}.post_attention_layernorm.weight"),
                             persistent=False)
        self.self_attn = MLAttention(config, loader, f"{prefix}.self_attn", attention_mode)
        self.mlp = DeepseekV2MoE(config, loader, f"{prefix}.mlp") if _is_moe_layer(config, layer) \
            else MLP(loader, f"{prefix}.mlp")

    def forward(self, x, cos, sin, seq_lens, start, cache, layer, scale, prefill):
        B, S, D = x.shape
        x = x + self.self_attn(rms_norm(x, self.input_norm, self.eps), cos, sin, seq_lens, start, cache, layer,
                               scale, prefill)
        return x + self.mlp(rms_norm(x, self.post_attention_norm, self.eps).view(B * S, D)).view(B, S, D)


class DeepseekV2ForCausalLM(nn.Module):
    """DeepSeek-V2 built from a WeightsLoader. forward(input_ids [B, S] int64, seq_lens [B] int32,
    cache: MLACache, start_pos [B] int32 or int) -> logits [B, S, vocab] fp32.

    A call is either a prefill from position 0 (right-padded, seq_lens valid tokens each) or a
    one-token decode step at positions start_pos[b]."""

    def __init__(self, config, loader, dtype: torch.dtype, device, attention_mode: str = "latent"):
        super().__init__()
        if attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention_mode={attention_mode!r}; expected one of {ATTENTION_MODES}")
        self.config, self.dtype, self.device, self.attention_mode = config, dtype, torch.device(device), attention_mode
        self.register_buffer("embed", loader.get_tensor("model.embed_tokens.weight"), persistent=False)
        self.layers = nn.ModuleList(DecoderLayer(config, loader, i, attention_mode)
                                    for i in range(config.num_hidden_layers))
        self.register_buffer("norm", loader.get_tensor("model.norm.weight"), persistent=False)
        lm_head = loader.get_linear("lm_head") if loader.has_tensor("lm_head.weight") else DenseWeight(self.embed)
        self.lm_head = Linear(lm_head)
        cos, sin, self.scale = rope_tables(config, config.max_position_embeddings)
        self.register_buffer("cos", cos.to(self.device), persistent=False)
        self.register_buffer("sin", sin.to(self.device), persistent=False)

    def new_cache(self, batch_size: int, max_seq_len: int) -> MLACache:
        """Zeroed cache for this model's attention mode (see kv_bytes_per_token for its size)."""
        c = self.config
        shape = dict(device=self.device, dtype=self.dtype)
        if self.attention_mode == "latent":
            keys = [torch.zeros(batch_size, max_seq_len, 1, c.kv_lora_rank + c.qk_rope_head_dim, **shape)
                    for _ in self.layers]
            return MLACache("latent", keys, [k[..., :c.kv_lora_rank] for k in keys])
        keys = [torch.zeros(batch_size, max_seq_len, c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim,
                            **shape) for _ in self.layers]
        values = [torch.zeros(batch_size, max_seq_len, c.num_attention_heads, c.v_head_dim, **shape)
                  for _ in self.layers]
        return MLACache("expanded", keys, values)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, cache: MLACache,
                start_pos: torch.Tensor | int = 0) -> torch.Tensor:
        B, S = input_ids.shape
        if cache.attention_mode != self.attention_mode:
            raise ValueError(f"cache is {cache.attention_mode!r} but the model runs {self.attention_mode!r}; "
                             "allocate it with model.new_cache()")
        start = torch.as_tensor(start_pos, dtype=torch.int32, device=input_ids.device).expand(B).contiguous()
        seq_lens = seq_lens.to(torch.int32)
        prefill = not bool(start.any())
        if not prefill and S != 1:
            raise ValueError(f"got {S} tokens at start_pos {start.tolist()}; DeepSeek-V2 forward takes a prefill "
                             "from position 0 or a one-token decode step")
        if int((start + S).max()) > cache.max_seq_len:
            raise ValueError(f"positions up to {int((start + S).max())} exceed the cache ({cache.max_seq_len}); "
                             "allocate a longer cache")
        positions = start[:, None].long() + torch.arange(S, device=input_ids.device)
        cos, sin = self.cos[positions], self.sin[positions]
        x = F.embedding(input_ids, self.embed)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, seq_lens, start, cache, i, self.scale, prefill)
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return self.lm_head(x.view(B * S, -1)).view(B, S, -1).float()
