"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: hybrid decoders of Gated DeltaNet (linear attention) and gated full attention.

config.layer_types names each layer "linear_attention" (three of four in the released checkpoints) or
"full_attention". Both kinds sit in a pre-norm layer as Llama's, with (1 + weight) RMSNorms (Gemma's).

  linear attention  x -> in projections -> mixed qkv [T, 2 Hk Dk + Hv Dv], z [T, Hv, Dv], b, a [T, Hv];
                    qkv -> causal depthwise conv (linear_conv_kernel_dim taps, silu) -> q, k [T, Hk, Dk], v;
                    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule over each
                    sequence's state S [Hv, Dk, Dv] (q, k l2-normalized, q scaled by Dk^-1/2; value head h reads
                    key head h // (Hv / Hk)); o = rmsnorm(o) * weight * silu(z) per value head; out_proj.
                    Qwen3.5 stores in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; Qwen3-Next in_proj_qkvz and
                    in_proj_ba, grouped by key head ([q, k, v, z] and [b, a] of each): regrouped after the GEMM.
  full attention    q_proj gives each head's query and an output gate (2 x head_dim, in that order per head);
                    (1 + w) RMSNorm on each q and k head; rope over the first head_dim * partial_rotary_factor
                    dims (0.25), half-split; the attention output times sigmoid(gate); o_proj.
  feed-forward      Qwen3.5: a SwiGLU MLP. Qwen3.5-MoE: every layer a softmax top-k router (renormalized), routed
                    experts and a shared expert scaled by sigmoid(shared_expert_gate). Qwen3-Next: as Qwen2-MoE
                    (norm_topk_prob, mlp_only_layers, decoder_sparse_step; the other layers a dense MLP).

The per-sequence state (conv window and delta-rule state of every linear layer, StateLayout) lives in the
engine's recurrent-state pool (tritonq.engine.state_cache) beside the paged KV cache of the attention layers;
the step names each sequence's slot (StepContext.state_slots). Kernels: tritonq.kernels.deltanet.
The released image-text checkpoints (qwen3_5, qwen3_5_moe) load their language model; the vision tower and the
multi-token-prediction layers (mtp.*) are left unread with one warning each.

Tensor parallel (loader.world = W > 1): rank r holds key heads [r Hk/W, (r+1) Hk/W) and the value heads that read
them, i.e. its slice of each part of the fused in projections (q, k, v of in_proj_qkv cut on their own: the
loader's segments in proportions; z, b, a; Qwen3-Next's per-key-head groups are whole), of the conv channels, A_log
and dt_bias, and a state of its heads only; out_proj is row-parallel (one all-reduce). Full attention splits its
query heads (each with its gate) and KV heads, o_proj row-parallel; MLP and MoE as in every model. Hk, Hv, the
attention heads and KV heads must each divide by W (refused naming them otherwise).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tritonq.formats.layers import Linear, RowParallelLinear
from tritonq.kernels.deltanet import (causal_conv1d, causal_conv1d_update, chunk_gated_delta_rule, gated_rms_norm,
                                      recurrent_gated_delta_rule)
from tritonq.kernels.norm_rope import apply_rope
from tritonq.models.common import (MLP, CausalLM, DecoderLayer, KVLayout, RopeTables, StateLayout, StepContext,
                                   logit_rows, paged_attention, rope_parameters)
from tritonq.models.gemma3 import gemma_norm
from tritonq.models.moe import MoERouting, SparseMoE
from tritonq.models.qwen_moe import _qwen_moe_layer

LAYER_TYPES = ("linear_attention", "full_attention")


def _float32(loader, name: str, shape: tuple) -> torch.Tensor:
    """A per-head parameter (A_log, dt_bias) in float32 as stored: g is computed in float32 (as transformers does)."""
    loader.check_float(name)
    return loader.weights.get_tensor(name, shape=shape).to(device=loader.device, dtype=torch.float32)


def _heads(loader, tensor: torch.Tensor, segments: int | tuple[int, ...] = 1) -> torch.Tensor:
    """This rank's heads of a per-channel tensor read whole (dim 0: fused blocks in `segments`' proportions)."""
    shard = loader.shard("column", segments=segments)
    return tensor if shard is None else shard.take(tensor, 0)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; see the module docstring. grouped: Qwen3-Next's in_proj_qkvz / in_proj_ba."""

    def __init__(self, config, loader, prefix: str, grouped: bool):
        super().__init__()
        W = loader.world
        Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.Hk, self.Hv = Hk // W, Hv // W  # this rank's heads
        self.Dk, self.Dv = Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
        D, key_dim, value_dim = config.hidden_size, Hk * Dk, Hv * Dv
        qkv = (key_dim, key_dim, value_dim)  # the conv's channel blocks, each cut by heads on its own
        self.conv_dim, self.grouped = (2 * key_dim + value_dim) // W, grouped
        if grouped:  # per key head groups: a plain column split gives whole groups
            self.in_proj = Linear(loader.get_linear(f"{prefix}.in_proj_qkvz", parallel="column",
                                                    shape=(2 * key_dim + 2 * value_dim, D)))
            self.in_proj_ba = Linear(loader.get_linear(f"{prefix}.in_proj_ba", parallel="column", shape=(2 * Hv, D)))
        else:
            self.in_proj = Linear(loader.get_fused_linear([f"{prefix}.in_proj_qkv", f"{prefix}.in_proj_z"],
                                                          parallel="column", segments=[qkv, 1],
                                                          shapes=[(sum(qkv), D), (value_dim, D)]))
            self.in_proj_ba = Linear(loader.get_fused_linear([f"{prefix}.in_proj_b", f"{prefix}.in_proj_a"],
                                                             parallel="column", shapes=[(Hv, D), (Hv, D)]))
        width = config.linear_conv_kernel_dim
        self.conv_weight = _heads(loader, loader.get_tensor(f"{prefix}.conv1d.weight", shape=(sum(qkv), 1, width))[:, 0],
                                  qkv)
        self.neg_A = _heads(loader, -_float32(loader, f"{prefix}.A_log", (Hv,)).exp())
        self.dt_bias = _heads(loader, _float32(loader, f"{prefix}.dt_bias", (Hv,)))
        self.norm_weight = loader.get_tensor(f"{prefix}.norm.weight", shape=(Dv,))
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(loader.get_linear(f"{prefix}.out_proj", parallel="row",
                                                            shape=(D, value_dim)), W)

    def projections(self, x: torch.Tensor):
        """x [T, D] -> mixed qkv [T, conv_dim] (q, k, v flat, the conv's channel order), z [T, Hv, Dv], b, a [T, Hv]."""
        T, Hk, Hv, Dk, Dv = x.shape[0], self.Hk, self.Hv, self.Dk, self.Dv
        if self.grouped:  # per key head: [q Dk, k Dk, v r Dv, z r Dv] and [b r, a r], r = Hv / Hk
            r = Hv // Hk
            q, k, v, z = self.in_proj(x).view(T, Hk, -1).split([Dk, Dk, r * Dv, r * Dv], dim=-1)
            b, a = self.in_proj_ba(x).view(T, Hk, 2 * r).split([r, r], dim=-1)
            qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
            return qkv, z.reshape(T, Hv, Dv), b.reshape(T, Hv), a.reshape(T, Hv)
        qkv, z = self.in_proj(x).split([self.conv_dim, Hv * Dv], dim=-1)
        b, a = self.in_proj_ba(x).split([Hv, Hv], dim=-1)
        return qkv.contiguous(), z.reshape(T, Hv, Dv), b.contiguous(), a.contiguous()

    def forward(self, x, cos, sin, ctx: StepContext, conv_state, ssm_state):
        """x [T, D] -> [T, D]; conv_state [slots, conv_dim, W-1] and ssm_state [slots, Hv, Dk, Dv] (fp32) of the
        sequences' slots ctx.state_slots are read and updated in place."""
        T, Hk, Hv, Dk, Dv = x.shape[0], self.Hk, self.Hv, self.Dk, self.Dv
        qkv, z, b, a = self.projections(x)
        slots = ctx.state_slots
        if ctx.is_prefill:
            qkv = causal_conv1d(qkv, self.conv_weight, None, conv_state, ctx.cu_seqlens_q, activation="silu",
                                state_indices=slots)
        else:  # one token per sequence
            qkv = causal_conv1d_update(qkv, self.conv_weight, None, conv_state, activation="silu",
                                       state_indices=slots)
        q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        q, k, v = q.reshape(T, Hk, Dk), k.reshape(T, Hk, Dk), v.reshape(T, Hv, Dv)
        beta = torch.sigmoid(b.float())
        g = self.neg_A * F.softplus(a.float() + self.dt_bias)
        if ctx.is_prefill:
            o = chunk_gated_delta_rule(q, k, v, g, beta, ssm_state, ctx.cu_seqlens_q, Dk ** -0.5,
                                       use_qk_l2norm=True, state_indices=slots)
        else:
            o = recurrent_gated_delta_rule(q, k, v, g, beta, ssm_state, Dk ** -0.5, use_qk_l2norm=True,
                                           state_indices=slots)
        o = gated_rms_norm(o.to(x.dtype), z, self.norm_weight, self.eps)
        return self.out_proj(o.reshape(T, Hv * Dv))


class GatedAttention(nn.Module):
    """One full-attention layer; see the module docstring."""

    def __init__(self, config, loader, prefix: str):
        super().__init__()
        H, Hkv, W = config.num_attention_heads, config.num_key_value_heads, loader.world
        if H % Hkv:
            raise ValueError(f"num_attention_heads={H} is not a multiple of num_key_value_heads="
                             f"{Hkv}; expected each KV head to serve the same number of query heads")
        self.num_heads, self.num_kv_heads = H // W, Hkv // W  # this rank's heads
        self.head_dim = hd = getattr(config, "head_dim", None) or config.hidden_size // H
        D = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(loader.get_fused_linear(  # q_proj: each head's query and gate together
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"], bias=bias, parallel="column",
            shapes=[(2 * H * hd, D), (Hkv * hd, D), (Hkv * hd, D)]))
        self.o_proj = RowParallelLinear(loader.get_linear(f"{prefix}.o_proj", bias=bias, parallel="row",
                                                          shape=(D, H * hd)), W)
        self.q_norm = gemma_norm(loader, f"{prefix}.q_norm", hd, config.rms_norm_eps)
        self.k_norm = gemma_norm(loader, f"{prefix}.k_norm", hd, config.rms_norm_eps)
        self.rotary_dim = rotary_dim(config, hd)
        self.scale = hd ** -0.5

    def forward(self, x, cos, sin, ctx: StepContext, k_pages, v_pages):
        T, H, Hkv, hd, rot = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim
        qg, k, v = self.qkv_proj(x).split([2 * H * hd, Hkv * hd, Hkv * hd], dim=-1)
        q, gate = qg.view(T, H, 2 * hd).split([hd, hd], dim=-1)
        qk = torch.cat([self.q_norm(q), self.k_norm(k.reshape(T, Hkv, hd))], dim=1)[None]  # [1, T, H + Hkv, hd]
        qk = torch.cat([apply_rope(qk[..., :rot].contiguous(), cos, sin), qk[..., rot:]], dim=-1)
        q, k = qk[0].split([H, Hkv], dim=1)
        out = paged_attention(q, k, v.reshape(T, Hkv, hd), ctx, k_pages, v_pages, self.scale)
        return self.o_proj(out.reshape(T, H * hd) * torch.sigmoid(gate.reshape(T, H * hd)))


def rotary_dim(config, head_dim: int) -> int:
    """The dims per head rope rotates: head_dim * partial_rotary_factor (even, positive), else a ValueError."""
    factor = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    dim = int(head_dim * factor)
    if not (0 < factor <= 1 and dim > 0 and dim % 2 == 0):
        raise ValueError(f"partial_rotary_factor={factor} with head_dim={head_dim} gives {dim} rotary dims; expected "
                         "a factor in (0, 1] giving an even, positive number of dims")
    return dim


class HybridLayer(DecoderLayer):
    """DecoderLayer (pre-norm, residual additions inside the next norm) with (1 + weight) RMSNorms; self_attn is
    a GatedDeltaNet (linear: True) or a GatedAttention, run on its layer's state or pages."""

    def __init__(self, config, loader, prefix: str, self_attn: nn.Module, mlp: nn.Module):
        nn.Module.__init__(self)
        D, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = gemma_norm(loader, f"{prefix}.input_layernorm", D, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = gemma_norm(loader, f"{prefix}.post_attention_layernorm", D, eps)
        self.mlp = mlp
        self.linear = isinstance(self_attn, GatedDeltaNet)


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 dense text model (model_type qwen3_5_text); see the module docstring. prefix: where the decoder's
    tensors are stored; grouped: Qwen3-Next's grouped in projections."""
    supports_compile = False
    prefix = "model"
    grouped = False

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None):
        mtp = [name for name in loader.weights.names() if name.startswith("mtp.")]
        if mtp:
            loader.leave_unread(mtp, "Qwen3.5 multi-token-prediction layers (mtp.*): only a speculative MTP head "
                                     "reads them, which this runtime does not run")
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != config.num_hidden_layers or set(types) - set(LAYER_TYPES) or "full_attention" not in types:
            raise ValueError(f"layer_types={types} is not supported: expected {config.num_hidden_layers} entries "
                             f"(num_hidden_layers), each one of {LAYER_TYPES}, at least one full_attention")
        Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
        if Hv % Hk:
            raise ValueError(f"linear_num_value_heads={Hv} is not a multiple of linear_num_key_heads={Hk}; expected "
                             "each key head to serve the same number of value heads")
        heads = {"linear_num_key_heads": Hk, "linear_num_value_heads": Hv,
                 "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads}
        if any(n % loader.world for n in heads.values()):
            raise ValueError(f"{', '.join(f'{k}={v}' for k, v in heads.items())}: tensor_parallel={loader.world} "
                             "must divide each (every rank holds whole key and value heads of the linear attention "
                             "and whole query and KV heads of the full attention); use a tensor_parallel that does")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; expected 'silu' (the conv's, MLP's "
                             "and experts' activation)")
        self.layer_types = types
        super().__init__(config, loader, dtype, device, max_seq_len=max_seq_len)
        W = loader.world  # this rank's state: its heads' conv channels and delta-rule states
        self.state_layout = StateLayout(types.count("linear_attention"), (2 * Hk * config.linear_key_head_dim +
                                        Hv * config.linear_value_head_dim) // W, config.linear_conv_kernel_dim,
                                        Hv // W, config.linear_key_head_dim, config.linear_value_head_dim)

    def build_mlp(self, config, loader, layer: int) -> nn.Module:
        """Layer `layer`'s feed-forward block: the dense MLP of intermediate_size."""
        return MLP(loader, f"{self.prefix}.layers.{layer}.mlp", config.hidden_size, config.intermediate_size)

    def build_layers(self, config, loader):
        for i, kind in enumerate(self.layer_types):
            prefix = f"{self.prefix}.layers.{i}"
            mixer = (GatedDeltaNet(config, loader, f"{prefix}.linear_attn", self.grouped) if kind == "linear_attention"
                     else GatedAttention(config, loader, f"{prefix}.self_attn"))
            yield HybridLayer(config, loader, prefix, mixer, self.build_mlp(config, loader, i))

    def build_norm(self, config, loader):
        return gemma_norm(loader, f"{self.prefix}.norm", config.hidden_size, config.rms_norm_eps)

    def _attention(self) -> GatedAttention:
        return next(layer.self_attn for layer in self.layers if not layer.linear)

    def cache_layout(self) -> KVLayout:
        """Pages for the full-attention layers only (the linear ones keep StateLayout's state)."""
        attn = self._attention()
        return KVLayout(self.layer_types.count("full_attention"), attn.num_kv_heads, attn.head_dim, attn.head_dim)

    def rope_dim(self) -> int:
        return self._attention().rotary_dim

    def position_tables(self, config, max_seq_len: int | None, dtype: torch.dtype) -> RopeTables:
        """Tables over the rotary dims (partial_rotary_factor is consumed by the attention's split). Qwen3.5's
        multimodal rope (mrope_section) gives every text position the same angle in all three sections: plain rope."""
        rope = {k: v for k, v in rope_parameters(config).items()
                if k not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}
        return RopeTables(self.rope_dim(), rope["rope_theta"], rope, config.max_position_embeddings,
                          max_seq_len or config.max_position_embeddings, self.device, dtype)

    @torch.inference_mode()
    def forward(self, ctx: StepContext, cache) -> torch.Tensor:
        """CausalLM.forward with each layer on its pages (attention) or its slice of the state pool (linear)."""
        cos, sin = self.rope(ctx)
        pages, states = zip(cache.k, cache.v), zip(cache.state.conv, cache.state.ssm)
        x, pending = self.embed_tokens(ctx.input_ids), None
        for layer in self.layers:
            x, pending = layer(x, pending, cos, sin, ctx, *next(states if layer.linear else pages))
        x = logit_rows(x, ctx) + logit_rows(pending, ctx)
        return self.lm_head(self.norm(x))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE text model (model_type qwen3_5_moe_text); see the module docstring."""
    supports_expert_parallel = False

    def build_mlp(self, config, loader, layer: int) -> nn.Module:
        return self._moe(config, loader, layer, renormalize=True)

    def _moe(self, config, loader, layer: int, renormalize: bool) -> SparseMoE:
        prefix, D = f"{self.prefix}.layers.{layer}.mlp", config.hidden_size
        shared = MLP(loader, f"{prefix}.shared_expert", D, config.shared_expert_intermediate_size, reduce=False)
        return SparseMoE(loader, prefix, MoERouting(config.num_experts_per_tok, "softmax", renormalize=renormalize),
                         config.num_experts, D, config.moe_intermediate_size, shared=shared, shared_gate=True)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next (model_type qwen3_next, e.g. Qwen3-Next-80B-A3B); see the module docstring."""
    grouped = True

    def build_mlp(self, config, loader, layer: int) -> nn.Module:
        if not _qwen_moe_layer(config, layer):
            return Qwen3_5ForCausalLM.build_mlp(self, config, loader, layer)
        return self._moe(config, loader, layer, renormalize=bool(config.norm_topk_prob))


class _ImageText:
    """The language model of a released Qwen3.5 image-text checkpoint: tensors under model.language_model.*, the
    head at lm_head; the vision tower (model.visual.*) is left unread with one warning: prompts are text."""
    prefix = "model.language_model"
    embedding = "model.language_model.embed_tokens"

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None):
        vision = [name for name in loader.weights.names() if name.startswith("model.visual.")]
        if vision:
            loader.leave_unread(vision, "Qwen3.5 vision tower: tritonq runs the language model on text prompts")
        super().__init__(config.get_text_config(), loader, dtype, device, max_seq_len=max_seq_len)


class Qwen3_5ImageTextForCausalLM(_ImageText, Qwen3_5ForCausalLM):
    """model_type qwen3_5 (e.g. Qwen3.5-9B as published)."""


class Qwen3_5MoeImageTextForCausalLM(_ImageText, Qwen3_5MoeForCausalLM):
    """model_type qwen3_5_moe (e.g. Qwen3.5-35B-A3B as published)."""
