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
DeepSeek-V2-Lite in bf16 (`kv_bytes_per_token`): latent 31,104 B/token, expanded 276,480 (8.9x).

Behaviour follows transformers' DeepseekV2 where it agrees with DeepSeek's original modeling
code; for the config fields transformers ignores we follow the original: moe_layer_freq (see
`_is_moe_layer`) and norm_topk_prob (see `DeepseekV2MoE`). Yarn's attention factor follows
transformers (the original differs only when just one of mscale / mscale_all_dim is set).
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
from tritonq.kernels.norm_rope import apply_rope, rope_cos_sin
from tritonq.layers import Embedding, Linear, RMSNorm
from tritonq.models.llama import KVCache

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


def _rope_parameters(config) -> dict:
    """The rope dict whichever transformers version wrote the config (rope_parameters or rope_scaling)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn with mscale_all_dim set
    (DeepSeek's long-context correction; the cos/sin carry the matching attention factor)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = _rope_parameters(config)
    if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        scale *= (0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0) ** 2 if factor > 1 else 1.0
    return scale


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] pairs (x0, x1), (x2, x3)... -> half-split (x0, x2, ..., x1, x3, ...)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


@dataclass(frozen=True)
class MLACache(KVCache):
    """Static cache allocated once per layer. expanded: k [B_max, S_max, H, Dn + Dr] and
    v [B_max, S_max, H, Dv]; latent: k [B_max, S_max, 1, R + Dr] holding [latent | k_rope] and
    v = k[..., :R], a view (the latent is stored once and serves as key prefix and value)."""
    attention_mode: str = "latent"


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate x) * up x), gate/up fused into one GEMM."""

    def __init__(self, loader, prefix: str, hidden: int | None = None, inter: int | None = None):
        super().__init__()
        up, down = ((inter, hidden), (hidden, inter)) if hidden else (None, None)  # expected (N, K), from the config
        self.gate_up = Linear(loader.get_fused_linear([f"{prefix}.gate_proj", f"{prefix}.up_proj"], shapes=[up, up]))
        self.down = Linear(loader.get_linear(f"{prefix}.down_proj", shape=down))

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
        D, inter = config.hidden_size, config.moe_intermediate_size
        self.router = loader.get_tensor(f"{prefix}.gate.weight", shape=(config.n_routed_experts, D)).float()  # fp32
        experts = [f"{prefix}.experts.{e}" for e in range(config.n_routed_experts)]
        self.gate_up = stack_experts([loader.get_fused_linear([f"{p}.gate_proj", f"{p}.up_proj"],
                                                              shapes=[(inter, D), (inter, D)]) for p in experts])
        self.down = loader.get_stacked([f"{p}.down_proj" for p in experts], shape=(D, inter))
        self.shared_experts = MLP(loader, f"{prefix}.shared_experts", D, inter * config.n_shared_experts) \
            if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        topk_weights, topk_ids = grouped_topk(
            x.float() @ self.router.T, self.top_k, n_group=self.n_group, topk_group=self.topk_group,
            scoring="softmax", renormalize=self.renormalize, routed_scaling_factor=self.routed_scaling_factor)
        out = fused_moe(x, self.gate_up, self.down, topk_weights, topk_ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class MLAttention(nn.Module):
    """Multi-head latent attention for one layer; see the module docstring for the two modes."""

    def __init__(self, config, loader, prefix: str, attention_mode: str, scale: float):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.attention_mode, self.scale = attention_mode, scale
        bias = bool(config.attention_bias)
        D, H, R, Q = config.hidden_size, self.num_heads, self.kv_lora_rank, config.q_lora_rank
        q_out = H * (self.nope_dim + self.rope_dim)
        # q_a_proj / kv_a_proj_with_mqa are replicated (never sharded) under tensor parallelism.
        if Q is None:
            self.q_proj = Linear(loader.get_linear(f"{prefix}.q_proj", shape=(q_out, D)))
        else:
            self.q_a_proj = Linear(loader.get_linear(f"{prefix}.q_a_proj", bias=bias, shape=(Q, D)))
            self.q_a_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.q_a_layernorm.weight", shape=(Q,)), LORA_NORM_EPS)
            self.q_b_proj = Linear(loader.get_linear(f"{prefix}.q_b_proj", shape=(q_out, Q)))
        self.q_lora_rank = config.q_lora_rank
        self.kv_a_proj_with_mqa = Linear(loader.get_linear(f"{prefix}.kv_a_proj_with_mqa", bias=bias,
                                                           shape=(R + self.rope_dim, D)))
        self.kv_a_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.kv_a_layernorm.weight", shape=(R,)), LORA_NORM_EPS)
        kv_b = loader.get_linear(f"{prefix}.kv_b_proj", shape=(H * (self.nope_dim + self.v_dim), R))
        self.kv_b_proj = Linear(kv_b)
        self.o_proj = Linear(loader.get_linear(f"{prefix}.o_proj", bias=bias, shape=(D, H * self.v_dim)))
        if attention_mode == "latent":
            # Absorbed decode needs kv_b per head as plain matrices: W_uk [H, Dn, R], W_uv [H, Dv, R].
            w = kv_b.dequantize().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
            self.w_uk, self.w_uv = w[:, :self.nope_dim].contiguous(), w[:, self.nope_dim:].contiguous()

    def forward(self, x, cos, sin, seq_lens, k_cache, v_cache, start_pos):
        """x [B, S, D]; cos/sin [B, S, Dr] at x's positions; seq_lens/start_pos [B] int32. S > 1: prefill from 0."""
        B, S, _ = x.shape
        H, Dn, Dr, Dv, R = self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, S, H, Dn + Dr).split([Dn, Dr], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([R, Dr], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, :, None]  # [B, S, 1, R]
        q_rope = apply_rope(_deinterleave(q_rope), cos, sin)
        k_rope = apply_rope(_deinterleave(k_rope)[:, :, None], cos, sin)  # [B, S, 1, Dr]

        if self.attention_mode == "latent":  # v_cache views k_cache[..., :R]: both writes store the latent
            write_kv_cache(k_cache, v_cache, torch.cat([latent, k_rope], dim=-1), latent, start_pos)
        if S > 1 or self.attention_mode == "expanded":
            k_nope, v = self.kv_b_proj(latent[:, :, 0]).view(B, S, H, Dn + Dv).split([Dn, Dv], dim=-1)
            k, q = torch.cat([k_nope, k_rope.expand(B, S, H, Dr)], dim=-1), torch.cat([q_nope, q_rope], dim=-1)
            v = v.contiguous()
            if self.attention_mode == "expanded":
                write_kv_cache(k_cache, v_cache, k, v, start_pos)
            if S > 1:
                out = prefill_attention(q, k, v, seq_lens, self.scale)
            else:
                out = decode_attention(q[:, 0], k_cache, v_cache, start_pos + 1, self.scale)
        else:  # latent decode: attend in the latent space, one shared kv head of width R + Dr
            q_latent = torch.einsum("bhn,hnr->bhr", q_nope[:, 0].float(), self.w_uk.float()).to(x.dtype)
            out_latent = decode_attention(torch.cat([q_latent, q_rope[:, 0]], dim=-1), k_cache, v_cache,
                                          start_pos + 1, self.scale)
            out = torch.einsum("bhr,hvr->bhv", out_latent.float(), self.w_uv.float()).to(x.dtype)
        return self.o_proj(out.reshape(B, S, H * Dv))


def _is_moe_layer(config, layer: int) -> bool:
    """DeepSeek's rule; transformers 5 ignores moe_layer_freq (treats it as 1)."""
    return (config.n_routed_experts is not None and layer >= config.first_k_dense_replace
            and layer % getattr(config, "moe_layer_freq", 1) == 0)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config, loader, layer: int, attention_mode: str, scale: float):
        super().__init__()
        prefix = f"model.layers.{layer}"
        eps = config.rms_norm_eps
        D = config.hidden_size
        self.input_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.input_layernorm.weight", shape=(D,)), eps)
        self.self_attn = MLAttention(config, loader, f"{prefix}.self_attn", attention_mode, scale)
        self.post_attention_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.post_attention_layernorm.weight",
                                                                  shape=(D,)), eps)
        self.mlp = DeepseekV2MoE(config, loader, f"{prefix}.mlp") if _is_moe_layer(config, layer) \
            else MLP(loader, f"{prefix}.mlp", D, config.intermediate_size)

    def forward(self, x, cos, sin, seq_lens, k_cache, v_cache, start_pos):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seq_lens, k_cache, v_cache, start_pos)
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h.view(-1, h.shape[-1])).view(h.shape)


class DeepseekV2ForCausalLM(nn.Module):
    """Built as DeepseekV2ForCausalLM(config, loader, dtype, device, attention_mode="latent").

    forward(input_ids [B, S] int64, seq_lens [B] int32, cache: MLACache, start_pos [B] int32)
    -> logits [B, S, V] (compute dtype), with the conventions of tritonq.models.llama: batches are
    right-padded; S > 1 is a prefill from position 0, S == 1 decodes one token per sequence.
    """

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str,
                 attention_mode: str = "latent"):
        super().__init__()
        if attention_mode not in ATTENTION_MODES:
            raise ValueError(f"attention_mode={attention_mode!r}; expected one of {ATTENTION_MODES}")
        self.config, self.dtype, self.device, self.attention_mode = config, dtype, torch.device(device), attention_mode
        table = (config.vocab_size, config.hidden_size)
        self.embed_tokens = Embedding(loader.get_embedding("model.embed_tokens", table))
        scale = softmax_scale(config)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, loader, i, attention_mode, scale)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(loader.get_tensor("model.norm.weight", shape=table[1:]), config.rms_norm_eps)
        head = loader.get_lm_head(bool(getattr(config, "tie_word_embeddings", False)), table)
        if head is None:  # tied (a quantized head on disk is always used; untied without one is an error)
            self.lm_head = Linear(DenseWeight(self.embed_tokens.weight))
            self.embed_tokens.weight = self.lm_head.weight.weight  # one table, in Linear's layout
        else:
            self.lm_head = Linear(head)
        self.cos, self.sin = self._rope_tables(min(4096, config.max_position_embeddings))

    def _rope_tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_positions, Dr] for the rope dims only (yarn's include its attention factor)."""
        rope = _rope_parameters(self.config)
        return rope_cos_sin(self.config.qk_rope_head_dim, rope["rope_theta"], num_positions, rope,
                            self.config.max_position_embeddings, self.device)

    def new_cache(self, max_batch: int, max_seq_len: int) -> MLACache:
        """The static cache for this model's attention mode (size: kv_bytes_per_token)."""
        c, n = self.config, len(self.layers)

        def zeros(heads, dim):
            return torch.zeros(max_batch, max_seq_len, heads, dim, dtype=self.dtype, device=self.device)
        if self.attention_mode == "latent":
            k = tuple(zeros(1, c.kv_lora_rank + c.qk_rope_head_dim) for _ in range(n))
            return MLACache(k=k, v=tuple(t[..., :c.kv_lora_rank] for t in k), attention_mode="latent")
        H = c.num_attention_heads
        return MLACache(k=tuple(zeros(H, c.qk_nope_head_dim + c.qk_rope_head_dim) for _ in range(n)),
                        v=tuple(zeros(H, c.v_head_dim) for _ in range(n)), attention_mode="expanded")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, cache: MLACache,
                start_pos: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits [B, S, V]; with last_only, [B, V] at each row's last valid token (position seq_lens-1)."""
        B, S = input_ids.shape
        if cache.attention_mode != self.attention_mode:
            raise ValueError(f"cache is {cache.attention_mode!r} but the model runs {self.attention_mode!r}; "
                             "allocate it with model.new_cache()")
        if B > cache.max_batch:
            raise ValueError(f"batch of {B} exceeds the cache's max_batch={cache.max_batch}; allocate a larger cache")
        if S > 1 and bool((start_pos != 0).any()):
            raise ValueError("a multi-token (prefill) step must start at position 0; chunked prefill is not supported")
        positions = start_pos[:, None].long() + torch.arange(S, device=input_ids.device)
        if int(positions.max()) >= min(cache.max_seq_len, self.config.max_position_embeddings):
            raise ValueError(f"position {int(positions.max())} is past the cache ({cache.max_seq_len}) or "
                             f"max_position_embeddings ({self.config.max_position_embeddings})")
        if int(positions.max()) >= self.cos.shape[0]:  # grow by doubling, not per step
            self.cos, self.sin = self._rope_tables(min(max(2 * self.cos.shape[0], int(positions.max()) + 1),
                                                       self.config.max_position_embeddings))
        used = (slice(0, B), slice(0, int(start_pos.max()) + S))  # attention reads only the rows in use
        cos, sin = self.cos[positions].to(self.dtype), self.sin[positions].to(self.dtype)  # [B, S, Dr], all layers
        x = self.embed_tokens(input_ids)
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x = layer(x, cos, sin, seq_lens, k_cache[used], v_cache[used], start_pos)
        if last_only:
            x = x[torch.arange(B, device=x.device), (seq_lens.long() - 1).clamp(min=0)]
        return self.lm_head(self.norm(x))
