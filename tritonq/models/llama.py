"""Llama-architecture decoder (Llama 1-3, Mistral-style GQA) built from typed weights.

forward(input_ids [B, S] int64, seq_lens [B] int32, cache: KVCache, start_pos [B] int32)
    -> logits [B, S, V] float (compute dtype).
Batches are right-padded: row b holds seq_lens[b] valid tokens at positions start_pos[b]...
Right padding with per-sequence lengths (instead of left padding) means positions need no
offsets and no pad token is ever attended: attention reads only cache positions < length.
A step with S > 1 is a prefill and must start at position 0; a step with S == 1 decodes one
token per sequence against the cache. The model never branches on the weight format: every
projection is a layers.Linear; q/k/v and gate/up are each one fused GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tritonq.formats.base import DenseWeight
from tritonq.kernels.attention import decode_attention, prefill_attention, write_kv_cache
from tritonq.kernels.norm_rope import apply_rope, rope_cos_sin
from tritonq.layers import Embedding, Linear, ParallelLMHead, RMSNorm, RowParallelLinear


@dataclass(frozen=True)
class KVCache:
    """Static cache allocated once: per layer k [B_max, S_max, Hkv, D] and v [B_max, S_max, Hkv, D]."""
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @property
    def max_batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_seq_len(self) -> int:
        return self.k[0].shape[1]


def _rope_scaling(config) -> dict | None:
    """The rope dict whichever transformers version wrote the config (rope_parameters or rope_scaling)."""
    scaling = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return dict(scaling) if scaling else None


class LlamaAttention(nn.Module):
    """Holds this rank's heads: num_heads / world query heads and num_kv_heads / world KV heads, or,
    with fewer KV heads than ranks, the one KV head its query heads use (replicated)."""

    def __init__(self, config, loader, prefix: str):
        super().__init__()
        heads, kv_heads, world = config.num_attention_heads, config.num_key_value_heads, loader.world
        if heads % world or (kv_heads % world and world % kv_heads):
            raise ValueError(f"{prefix}: num_attention_heads={heads} and num_key_value_heads={kv_heads} cannot be "
                             f"divided across tensor_parallel={world} ranks; the query heads must divide by it, and "
                             "the KV heads divide by it or it by them")
        self.num_heads, self.num_kv_heads = heads // world, max(kv_heads // world, 1)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = bool(getattr(config, "attention_bias", False))
        D, q_dim, kv_dim = config.hidden_size, heads * self.head_dim, kv_heads * self.head_dim
        # Column-parallel q, k, v (each sharded by heads, then fused); row-parallel o over this rank's heads.
        self.qkv_proj = Linear(loader.get_fused_linear([f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
                                                       bias=bias, parallel="column", parts=[None, kv_heads, kv_heads],
                                                       shapes=[(q_dim, D), (kv_dim, D), (kv_dim, D)]))
        self.o_proj = RowParallelLinear(loader.get_linear(f"{prefix}.o_proj", bias=bias, parallel="row",
                                                          shape=(D, q_dim)), world)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, seq_lens, k_cache, v_cache, start_pos):
        B, S, _ = x.shape
        H, H_kv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(B, S, H + 2 * H_kv, self.head_dim)
        q, k = apply_rope(qkv[:, :, :H + H_kv], cos, sin).split([H, H_kv], dim=2)  # q and k heads in one call
        v = qkv[:, :, H + H_kv:]
        write_kv_cache(k_cache, v_cache, k, v, start_pos)
        if S == 1:
            out = decode_attention(q[:, 0], k_cache, v_cache, start_pos + 1, self.scale)[:, None]
        else:
            out = prefill_attention(q, k, v, seq_lens, self.scale, causal=True)
        return self.o_proj(out.reshape(B, S, H * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config, loader, prefix: str):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
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
    def __init__(self, config, loader, prefix: str):
        super().__init__()
        eps = config.rms_norm_eps
        D = (config.hidden_size,)
        self.input_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.input_layernorm.weight", shape=D), eps)
        self.self_attn = LlamaAttention(config, loader, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(loader.get_tensor(f"{prefix}.post_attention_layernorm.weight", shape=D),
                                                eps)
        self.mlp = LlamaMLP(config, loader, f"{prefix}.mlp")

    def forward(self, x, cos, sin, seq_lens, k_cache, v_cache, start_pos):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seq_lens, k_cache, v_cache, start_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Built as LlamaForCausalLM(config, loader, dtype, device); see the module docstring.

    Tensor parallel when loader.world > 1: every rank runs forward on the same inputs and gets the
    full logits; its KV cache holds only its KV heads.
    """
    supports_tensor_parallel = True

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        world = loader.world
        if config.vocab_size % world:
            raise ValueError(f"vocab_size={config.vocab_size} is not divisible by tensor_parallel={world}: the "
                             "embedding and lm_head are split by vocabulary rows; use a tensor_parallel that divides it")
        # Vocab-parallel: this rank's V/world rows of the embedding and of lm_head (tied: the same rows).
        table = (config.vocab_size, config.hidden_size)
        self.embed_tokens = Embedding(loader.get_embedding("model.embed_tokens", table, dim=0), loader.rank, world)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, loader, f"model.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(loader.get_tensor("model.norm.weight", shape=table[1:]), config.rms_norm_eps)
        # None: tied to the embedding; a quantized head on disk is always used; untied without one is an error.
        head = loader.get_lm_head(bool(getattr(config, "tie_word_embeddings", False)), table, parallel="column")
        tied = head is None
        self.lm_head = ParallelLMHead(DenseWeight(self.embed_tokens.weight) if tied else head, world)
        if tied:  # one table: Linear may have re-laid it out for the CPU GEMV; the lookup reads either layout
            self.embed_tokens.weight = self.lm_head.weight.weight
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.rope_scaling = _rope_scaling(config)
        self.rope_theta = (self.rope_scaling or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
        self._rope_tables = None  # (num_positions, cos, sin), built for the cache length at first use

    def new_cache(self, max_batch: int, max_seq_len: int) -> KVCache:
        """The static KV cache, allocated once (at warmup), never grown."""
        shape = (max_batch, max_seq_len, self.num_kv_heads, self.head_dim)
        n = len(self.layers)
        return KVCache(k=tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)),
                       v=tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)))

    def _cos_sin(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type"))
        if kind == "dynamic":  # the NTK base depends on the current length, as in transformers
            return rope_cos_sin(self.head_dim, self.rope_theta, num_positions, self.rope_scaling,
                                self.config.max_position_embeddings, self.device)
        if self._rope_tables is None or self._rope_tables[0] < num_positions:
            size = max(num_positions, 2 * self._rope_tables[0] if self._rope_tables else 256)  # grow rarely
            cos, sin = rope_cos_sin(self.head_dim, self.rope_theta, size, self.rope_scaling,
                                    self.config.max_position_embeddings, self.device)
            self._rope_tables = (size, cos, sin)
        return self._rope_tables[1], self._rope_tables[2]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, seq_lens: torch.Tensor, cache: KVCache,
                start_pos: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Logits [B, S, V]; with last_only, [B, V] at each row's last valid token (position seq_lens-1)."""
        B, S = input_ids.shape
        if B > cache.max_batch:
            raise ValueError(f"batch of {B} exceeds the cache's max_batch={cache.max_batch}; "
                             "load the model with a larger max_batch.")
        if S > 1 and bool((start_pos != 0).any()):
            raise ValueError("a multi-token (prefill) step must start at position 0; chunked prefill is not supported.")
        positions = start_pos[:, None].long() + torch.arange(S, device=input_ids.device)
        cos, sin = self._cos_sin(int(positions.max()) + 1)
        cos, sin = cos[positions].to(self.dtype), sin[positions].to(self.dtype)  # [B, S, D], for all layers
        # Attention sees only the cache rows in use, so a long max_seq_len costs nothing on CPU.
        used = (slice(0, B), slice(0, int(start_pos.max()) + S))
        x = self.embed_tokens(input_ids)
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v):
            x = layer(x, cos, sin, seq_lens, k_cache[used], v_cache[used], start_pos)
        if last_only:
            x = x[torch.arange(B, device=x.device), (seq_lens.long() - 1).clamp(min=0)]
        return self.lm_head(self.norm(x))

