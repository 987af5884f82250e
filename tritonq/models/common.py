"""What every model shares: the paged KV cache, one step's packed inputs, rope tables, the logits rows.

A step (built by tritonq.engine.runner) packs the new tokens of B sequences into T rows:

    StepContext
      input_ids    [T] int64   the new tokens, sequence after sequence
      positions    [T] int64   their positions in their sequences
      slot_mapping [T] int64   where each token's K/V goes: page slot // block_size, row slot % block_size
                               (< 0: not written, e.g. a token whose KV a shared prefix block already holds)
      cu_seqlens_q [B+1] int32 sequence b's tokens are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1
      context_lens [B] int32   tokens of sequence b with KV in the cache after this step's writes
      block_table  [B, max_blocks] int32  page of each block of each sequence (-1 past its blocks)
      logit_rows   [R] int64 or None      rows whose logits are wanted (each sequence's last new
                               token); None: every row (full prefill logits, for scoring and tests)
      is_prefill   bool        True: varlen attention over cached pages + the new tokens (new
                               prompts, prefix hits, chunked prefill, resumed sequences); False:
                               every sequence has exactly one new token (decode kernel).
      max_position, num_context_tokens, num_context_blocks  host ints (largest position, sum of
                               context_lens, sum of their blocks), so models need no device read to
                               check rope tables or size MLA's expansion.
    Its values are checked once, by the runner that builds it (slots within the cache, lengths within
    the block table), so models pass them to the kernels with check_values=False.
      num_seqs     int or None a decode step padded to a batch bucket (tritonq.engine.cuda_graphs):
                               only its first num_seqs rows are sequences; the rest are padding
                               (slot -1, context length 0) whose outputs are ignored. None: no padding.
      state_slots  [B] int64 or None  a hybrid model's step: each sequence's slot in the recurrent-state
                               pool (PagedKVCache.state; a padded decode step's padding rows name the pool's
                               scratch slot). None for models without recurrent state.
      num_logits   int or None a prefill-attention step padded to a token bucket (a mixed step,
                               tritonq.engine.cuda_graphs.StaticMixedInputs): logit_rows has a row per
                               sequence slot, and only the first num_logits logits are wanted. None: no padding.

A model's forward(ctx, cache) writes each layer's new K/V into its pages, attends, and returns
logits [R, V] (or [T, V]) in the compute dtype.

The skeleton the rotary models share is here too, once: `CausalLM` (vocab-parallel embedding, the decoder
layers, final norm, tied or untied lm_head, the forward over the layers), `DecoderLayer` (pre-norm attention
and feed-forward with RMSNorms), `MLP` (SwiGLU), `paged_attention` (write a layer's K/V, then prefill or decode
attention) and `rope_parameters` / `rope_tables` (the only reader of a config's rope settings). A model
class states what differs: its attention, its feed-forward (MLP or a mixture of experts), its norms and names.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tritonq.kernels.attention import (QuantizedPages, decode_attention, paged_prefill_attention, rope_write_kv_slots,
                                      write_kv_slots)
from tritonq.kernels.norm_rope import rope_cos_sin
from tritonq.formats.layers import Embedding, GateUpLinear, Linear, ParallelLMHead, RMSNorm, RowParallelLinear
from tritonq.quant.weights import DenseWeight

KV_SCALE_BYTES = 4  # an int8 cache's fp32 scale per token, kv head and k / v


@dataclass(frozen=True)
class StepContext:
    """One step's packed inputs; see the module docstring."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_table: torch.Tensor
    logit_rows: torch.Tensor | None
    is_prefill: bool
    max_position: int  # the largest position in the step (host int: checked against the rope tables)
    num_context_tokens: int  # sum of context_lens (host int: MLA's prefill expands that many K/V rows)
    num_context_blocks: int  # sum of ceil(context_lens / block_size) (host int: ... into that many pages)
    num_seqs: int | None = None  # padded decode step: its real rows (the rest are padding); None: all real
    state_slots: torch.Tensor | None = None  # hybrid models: each sequence's recurrent-state slot
    num_logits: int | None = None  # padded mixed step: its first num_logits logits rows are wanted; None: all


@dataclass(frozen=True)
class RecurrentState:
    """A hybrid model's recurrent-state pool (StateLayout.allocate): per linear-attention layer, conv[l]
    [slots, conv_dim, conv_width - 1] (the last inputs of the causal conv, compute dtype) and ssm[l]
    [slots, heads, d_k, d_v] float32 (the delta-rule state). A sequence owns one slot (StepContext.state_slots)."""
    conv: tuple[torch.Tensor, ...]
    ssm: tuple[torch.Tensor, ...]

    @property
    def num_slots(self) -> int:
        return self.ssm[0].shape[0]

    def zero(self, slots: torch.Tensor) -> None:
        """Zero the given slots in every layer: a sequence that starts at position 0 starts from no state."""
        for conv, ssm in zip(self.conv, self.ssm):
            conv.index_fill_(0, slots, 0)
            ssm.index_fill_(0, slots, 0)


@dataclass(frozen=True)
class StateLayout:
    """What a hybrid model's linear-attention layers keep per sequence (fixed size, whatever its length):
    num_layers layers, each a conv window of conv_width - 1 inputs of conv_dim channels and a delta-rule state of
    num_heads x d_k x d_v float32 values."""
    num_layers: int
    conv_dim: int
    conv_width: int
    num_heads: int
    d_k: int
    d_v: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """The state of one sequence across all layers, in bytes (conv window in dtype, delta-rule state fp32)."""
        conv = self.conv_dim * (self.conv_width - 1) * torch.empty((), dtype=dtype).element_size()
        return self.num_layers * (conv + self.num_heads * self.d_k * self.d_v * 4)

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> RecurrentState:
        """Zeroed state for num_slots sequences in every layer."""
        return RecurrentState(
            conv=tuple(torch.zeros(num_slots, self.conv_dim, self.conv_width - 1, dtype=dtype, device=device)
                       for _ in range(self.num_layers)),
            ssm=tuple(torch.zeros(num_slots, self.num_heads, self.d_k, self.d_v, dtype=torch.float32, device=device)
                      for _ in range(self.num_layers)))


@dataclass(frozen=True)
class PagedKVCache:
    """Per layer k pages [num_blocks, block_size, Hkv, Dqk] and v pages [num_blocks, block_size, Hkv, Dv]
    (QuantizedPages for kv_cache_dtype fp8 / int8).

    Pages are shared by all sequences; a sequence's block_table names its pages. With a latent
    (MLA) cache, v is a strided view of k (v = k[..., :Dv]): the latent is stored once. A hybrid model's cache
    has pages for its attention layers only and, in `state`, its linear-attention layers' recurrent-state pool."""
    k: tuple[torch.Tensor | QuantizedPages, ...]
    v: tuple[torch.Tensor | QuantizedPages, ...]
    state: RecurrentState | None = None

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


@dataclass(frozen=True)
class KVLayout:
    """What one layer's cache holds per token: Hkv heads of Dqk (k) and Dv (v) values; v_in_k: v is
    the first Dv values of k (MLA's latent), so only k is allocated.
    cache_dtype (tritonq.config.KV_CACHE_DTYPES): "auto" stores the model dtype; "fp8" / "int8" 8-bit QuantizedPages.
    fp8_scales: fp8's per-layer (k_scale, v_scale) (tritonq.load reads them from the checkpoint, else 1.0)."""
    num_layers: int
    num_kv_heads: int
    d_qk: int
    d_v: int
    v_in_k: bool = False
    cache_dtype: str = "auto"
    fp8_scales: tuple[tuple[float, float], ...] | None = None

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV-cache bytes one token costs across all layers (with a compute dtype of `dtype`): values, plus
        an int8 cache's scales (one per kv head for k and one for v; one for MLA's shared latent)."""
        per_head = self.d_qk if self.v_in_k else self.d_qk + self.d_v
        if self.cache_dtype == "auto":
            return self.num_layers * self.num_kv_heads * per_head * torch.empty((), dtype=dtype).element_size()
        scales = 0 if self.cache_dtype == "fp8" else KV_SCALE_BYTES * (1 if self.v_in_k else 2)
        return self.num_layers * self.num_kv_heads * (per_head + scales)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> PagedKVCache:
        """Zeroed pages for num_blocks blocks of block_size tokens in every layer (8-bit with their scales
        unless cache_dtype is "auto")."""
        shape = (num_blocks, block_size, self.num_kv_heads)
        page_dtype = {"auto": dtype, "fp8": torch.float8_e4m3fn, "int8": torch.int8}[self.cache_dtype]

        def pages(dim: int) -> torch.Tensor:
            return torch.zeros(*shape, dim, dtype=page_dtype, device=device)

        def scale(layer: int, which: int) -> torch.Tensor:
            if self.cache_dtype == "int8":
                return torch.zeros(shape, dtype=torch.float32, device=device)
            value = self.fp8_scales[layer][which] if self.fp8_scales else 1.0
            return torch.tensor(value, dtype=torch.float32, device=device)

        k, v = [], []
        for layer in range(self.num_layers):
            k_pages = pages(self.d_qk)
            v_pages = k_pages[..., :self.d_v] if self.v_in_k else pages(self.d_v)
            if self.cache_dtype != "auto":  # MLA's latent v shares k's bytes and scale tensor
                k_pages = QuantizedPages(k_pages, scale(layer, 0))
                v_pages = QuantizedPages(v_pages, k_pages.scale if self.v_in_k else scale(layer, 1))
            k.append(k_pages)
            v.append(v_pages)
        return PagedKVCache(k=tuple(k), v=tuple(v))


class RopeTables:
    """cos / sin rows at a step's positions, shaped for apply_rope.

    Static rope types (default / linear / llama3 / yarn): one table of max_seq_len rows, built once at
    construction in the compute dtype (a decode step captured in a CUDA graph gathers from a tensor
    that never moves). A step past max_seq_len is refused (the engine never schedules one).

    Dynamic NTK: the base depends on the sequence length, so each token's cos / sin are computed in
    the step from its own sequence's length (context_lens of its sequence: the tokens with KV after
    this step, what transformers' max(position_ids) + 1 is for that sequence alone). A prompt's
    result therefore never depends on what else is batched with it. All on the device, no host read.
    Cached K keeps the rotation of the step that wrote it (as in transformers' own KV cache), so a prompt
    prefilled in chunks, or reusing prefix-cached blocks another request wrote, past the trained length
    differs from one whole-prompt forward; one-step prefills without a prefix hit match it exactly.
    """

    def __init__(self, head_dim: int, base: float, scaling: dict | None, max_position_embeddings: int,
                 max_seq_len: int, device: torch.device, dtype: torch.dtype):
        scaling = dict(scaling or {})
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"rope partial_rotary_factor={scaling['partial_rotary_factor']} is not supported (rope "
                             "over the whole head only); expected 1.0 or no such key.")
        self.head_dim, self.max_seq_len, self.dtype = head_dim, max_seq_len, dtype
        self.dynamic = kind == "dynamic"
        if self.dynamic:
            # The length past which the base grows: the pretraining length. transformers passes
            # max_position_embeddings (its docs list original_max_position_embeddings for yarn / llama3 /
            # longrope only, defined as "the original max position embeddings used during pretraining").
            # Without the key both are the same number. With it, the checkpoint has raised
            # max_position_embeddings to the extended length and names the trained length in the key (as
            # yarn configs do): dynamic NTK is defined relative to the trained length (scale = factor *
            # L / L_train - (factor - 1)), and transformers' rule would leave positions between the trained
            # and the extended length unscaled, i.e. never trained. So the key wins when present.
            self.original = int(scaling.get("original_max_position_embeddings", max_position_embeddings))
            self.base, self.factor = float(base), float(scaling["factor"])
            self.exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        else:
            cos, sin = rope_cos_sin(head_dim, base, max_seq_len, scaling, max_position_embeddings, device)
            self.cos, self.sin = cos.to(dtype), sin.to(dtype)

    def __call__(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, T, D] in the compute dtype: rows at ctx.positions, shaped for apply_rope."""
        if ctx.max_position >= self.max_seq_len:  # a host int: no device read
            raise ValueError(f"position {ctx.max_position} is past the rope tables' max_seq_len={self.max_seq_len}; "
                             "build the model with a larger max_seq_len.")
        if not self.dynamic:
            return self.cos[ctx.positions][None], self.sin[ctx.positions][None]
        T = ctx.positions.shape[0]
        counts = ctx.cu_seqlens_q[1:] - ctx.cu_seqlens_q[:-1]
        seq_len = torch.repeat_interleave(ctx.context_lens, counts, output_size=T)  # [T]: its sequence's length
        # transformers' NTK base at seq_len (unchanged at or below the trained length), in float32 as there.
        length = seq_len.float().clamp(min=self.original)
        d = self.head_dim
        base = self.base * (self.factor * length / self.original - (self.factor - 1)) ** (d / (d - 2))  # [T]
        inv_freq = 1.0 / base[:, None] ** self.exponents  # [T, D/2]
        angles = ctx.positions.float()[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(self.dtype)[None], angles.sin().to(self.dtype)[None]


class NoRope:
    """What a model without rotary positions (ALiBi: MPT) gives its layers for a step: cos = sin = None. As
    RopeTables, it refuses a step past max_seq_len."""

    def __init__(self, max_seq_len: int):
        self.max_seq_len = max_seq_len

    def __call__(self, ctx: StepContext) -> tuple[None, None]:
        if ctx.max_position >= self.max_seq_len:  # a host int: no device read
            raise ValueError(f"position {ctx.max_position} is past max_seq_len={self.max_seq_len}; build the model "
                             "with a larger max_seq_len.")
        return None, None


def logit_rows(x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The hidden rows whose logits are wanted: x [T, D] -> [R, D] (all of x when ctx.logit_rows is None)."""
    return x if ctx.logit_rows is None else x[ctx.logit_rows]


def rope_parameters(config) -> dict:
    """The config's rope settings, read here only: the dict whichever transformers version wrote it
    (rope_parameters or rope_scaling; {} when neither), with rope_theta (the dict's own, else config.rope_theta,
    else 10000)."""
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


def rope_tables(config, head_dim: int, max_seq_len: int | None, device: torch.device, dtype: torch.dtype) -> RopeTables:
    """The cos / sin tables of a rotary model over head_dim dims per head, sized for max_seq_len (default
    max_position_embeddings); yarn's tables include its attention factor."""
    rope = rope_parameters(config)
    return RopeTables(head_dim, rope["rope_theta"], rope, config.max_position_embeddings,
                      max_seq_len or config.max_position_embeddings, device, dtype)


def paged_attention(q, k, v, ctx: StepContext, k_pages, v_pages, scale: float, **options) -> torch.Tensor:
    """Write the step's k [T, Hkv, Dqk], v [T, Hkv, Dv] into this layer's pages and attend q [T, H, Dqk] over each
    sequence's cached keys (prefill: varlen over cached pages + new tokens; decode: one row per sequence)
    -> [T, H, Dv]. options: what both kernels take beyond that (window, sinks, alibi_slopes)."""
    write_kv_slots(k_pages, v_pages, k, v, ctx.slot_mapping, check_values=False)  # checked once by the runner
    return attend(q, ctx, k_pages, v_pages, scale, **options)


def rope_paged_attention(q, k, v, cos, sin, ctx: StepContext, k_pages, v_pages, scale: float, q_norm=None,
                         k_norm=None, **options) -> torch.Tensor:
    """paged_attention of a rotary layer before its rope: q [T, H, D] and k [T, Hkv, D] are rotated by cos / sin
    [1, T, D] (after the per-head RMSNorms q_norm / k_norm when given: Qwen3's qk-norm) as the new keys are written
    (kernels.attention.rope_write_kv_slots: one launch on a GPU), then attend as paged_attention."""
    norms = {} if q_norm is None else dict(q_norm=q_norm.weight, k_norm=k_norm.weight, eps=q_norm.eps)
    q = rope_write_kv_slots(q, k, v, cos[0], sin[0], k_pages, v_pages, ctx.slot_mapping, check_values=False, **norms)
    return attend(q, ctx, k_pages, v_pages, scale, **options)


def attend(q, ctx: StepContext, k_pages, v_pages, scale: float, **options) -> torch.Tensor:
    """q [T, H, Dqk] over each sequence's cached keys (the step's already written) -> [T, H, Dv]: prefill's varlen
    kernel or decode's, with options (window, sinks, alibi_slopes)."""
    if ctx.is_prefill:
        return paged_prefill_attention(q, k_pages, v_pages, ctx.cu_seqlens_q, ctx.context_lens, ctx.block_table,
                                       scale, check_values=False, **options)
    return decode_attention(q, k_pages, v_pages, ctx.context_lens, ctx.block_table, scale, **options)


def rms_norm(loader, prefix: str, config) -> RMSNorm:
    """The RMSNorm `<prefix>.weight` [hidden_size] with eps config.rms_norm_eps."""
    return RMSNorm(loader.get_tensor(f"{prefix}.weight", shape=(config.hidden_size,)), config.rms_norm_eps)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate x) * up x) [T, D] -> [T, D], gate/up fused into one GEMM (a dense layer or a
    shared expert); split by intermediate size over the ranks (gate/up column-, down row-parallel).
    bias: gate/up/down carry biases (Llama's mlp_bias). reduce=False leaves the rank's partial sum for the caller
    to all-reduce (shared experts: the MoE block reduces them with the routed experts, once). hidden / inter:
    the expected sizes from the config (None: take the stored ones). gate_up: the first GEMM's layer (a subclass
    with another activation takes a plain Linear and applies it in forward)."""

    gate_up: type[Linear] = GateUpLinear

    def __init__(self, loader, prefix: str, hidden: int | None = None, inter: int | None = None, bias: bool = False,
                 reduce: bool = True):
        super().__init__()
        up, down = ((inter, hidden), (hidden, inter)) if hidden else (None, None)  # expected (N, K)
        self.gate_up_proj = self.gate_up(loader.get_fused_linear([f"{prefix}.gate_proj", f"{prefix}.up_proj"],
                                                                 bias=bias, parallel="column", shapes=[up, up]))
        down_weight = loader.get_linear(f"{prefix}.down_proj", bias=bias, parallel="row", shape=down)
        self.down_proj = RowParallelLinear(down_weight, loader.world) if reduce else Linear(down_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))  # silu(gate) * up: in the GEMM's epilogue where it can be


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: x + self_attn(input_layernorm(x)), then + mlp(post_attention_layernorm(x)), with
    RMSNorms at `<prefix>.input_layernorm` / `<prefix>.post_attention_layernorm` (Llama's, Qwen's, DeepSeek's).

    self_attn.attend(x, cos, sin, ctx, k_pages, v_pages) maps [T, D] to its heads' outputs before self_attn.o_proj
    (an attention without attend: self_attn(x, ...) [T, D] -> [T, D]), mlp(x) [T, D] -> [T, D]; the model builds them. forward(x, pending, ...) -> (x, pending): the residual stream
    and what is still to be added to it (the previous layer's mlp output, None before the first layer), so each
    residual addition happens inside the norm after it (`RMSNorm.add_norm`: one launch on a GPU, one C pass on the
    CPU), or at decode inside o_proj's GEMM (`Linear.add_norm`: its epilogue adds and normalizes)."""

    def __init__(self, config, loader, prefix: str, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = rms_norm(loader, f"{prefix}.input_layernorm", config)
        self.self_attn = self_attn
        self.post_attention_layernorm = rms_norm(loader, f"{prefix}.post_attention_layernorm", config)
        self.mlp = mlp

    def forward(self, x, pending, cos, sin, ctx: StepContext, k_pages, v_pages):
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_norm(x, pending)
        attend = getattr(self.self_attn, "attend", None)
        if attend is None:  # an attention that ends in a projection of its own (Qwen3.5's gated ones)
            x, h = self.post_attention_layernorm.add_norm(x, self.self_attn(h, cos, sin, ctx, k_pages, v_pages))
        else:
            out = attend(h, cos, sin, ctx, k_pages, v_pages)
            x, h = self.self_attn.o_proj.add_norm(out, x, self.post_attention_layernorm)
        return x, self.mlp(h)


class CausalLM(nn.Module):
    """The rotary causal LM every such model class is: built as Cls(config, loader, dtype, device, max_seq_len=None,
    **options), forward(ctx, cache) -> logits [R, V] (compute dtype; see the module docstring).

    embed_tokens (vocab-parallel: this rank's V/world rows) -> each of `layers`, layer(x, pending, cos, sin, ctx,
    k_pages, v_pages) -> (x, pending), on its own pages (pending: a last residual term the next layer adds, or
    None; see DecoderLayer) -> norm over the logit rows -> lm_head (vocab-parallel, logits gathered to [R, V]).
    A model class states what differs: build_layers (its layers; **options go there), build_norm (the final norm),
    the class attributes `embedding` (the stored embedding's name) and `tie_word_embeddings` (the default when the
    config has no such key), and, when its first layer's `self_attn` is not a plain multi-head attention,
    cache_layout / rope_dim; a model without rope (ALiBi) overrides position_tables.

    Tensor parallel when loader.world > 1: every rank runs forward on the same inputs and gets the full logits;
    its KV cache holds only its KV heads (kv_layout is per rank).
    """
    supports_tensor_parallel = True
    # A prefill-attention step (a speculative verification of k + 1 queries a sequence, a mixed prefill + decode step)
    # can run at fixed shapes (engine/cuda_graphs.py): it reads no host count of the context (MLA's prefill does:
    # DeepSeek-V2 turns this off).
    static_prefill = True
    embedding = "model.embed_tokens"
    tie_word_embeddings = False

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None,
                 **options):
        """max_seq_len (default max_position_embeddings): the longest sequence the rope tables cover."""
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        world = loader.world
        if config.vocab_size % world:
            raise ValueError(f"vocab_size={config.vocab_size} is not divisible by tensor_parallel={world}: the "
                             "embedding and lm_head are split by vocabulary rows; use a tensor_parallel that divides it")
        table = (config.vocab_size, config.hidden_size)
        self.embed_tokens = Embedding(loader.get_embedding(self.embedding, table, dim=0), loader.rank, world)
        self.layers = nn.ModuleList(self.build_layers(config, loader, **options))
        self.norm = self.build_norm(config, loader)
        self.lm_head = self._vocab_parallel_head(config, loader, table)
        self.kv_layout = self.cache_layout()
        self.rope = self.position_tables(config, max_seq_len, dtype)

    def build_layers(self, config, loader, **options) -> Iterable[nn.Module]:
        """The decoder layers, in order."""
        raise NotImplementedError

    def build_norm(self, config, loader) -> nn.Module:
        """The final norm before lm_head: the RMSNorm model.norm."""
        return rms_norm(loader, "model.norm", config)

    def cache_layout(self) -> KVLayout:
        """What each layer's cache holds per token on this rank: its self_attn's num_kv_heads heads of head_dim."""
        attn = self.layers[0].self_attn
        return KVLayout(len(self.layers), attn.num_kv_heads, attn.head_dim, attn.head_dim)

    def rope_dim(self) -> int:
        """The dims per head that rope rotates: the whole head."""
        return self.layers[0].self_attn.head_dim

    def position_tables(self, config, max_seq_len: int | None, dtype: torch.dtype) -> RopeTables | NoRope:
        """What each step's layers get for the positions (cos, sin): rope tables over rope_dim() dims per head."""
        return rope_tables(config, self.rope_dim(), max_seq_len, self.device, dtype)

    def _vocab_parallel_head(self, config, loader, table: tuple[int, int]) -> ParallelLMHead:
        """lm_head over this rank's vocabulary rows: the checkpoint's own (a quantized head on disk is always used),
        or, when tie_word_embeddings holds and there is none, the embedding's table itself; then the embedding reads
        the head's tensor (one table: Linear may have re-laid it out for the CPU GEMV, and the lookup reads either
        layout). Untied without a head on disk is an error (loader.get_lm_head)."""
        tied = bool(getattr(config, "tie_word_embeddings", self.tie_word_embeddings))
        head = loader.get_lm_head(tied, table, parallel="column")
        lm_head = ParallelLMHead(DenseWeight(self.embed_tokens.weight) if head is None else head, loader.world)
        if head is None:
            self.embed_tokens.weight = lm_head.weight.weight
        return lm_head

    @torch.inference_mode()
    def forward(self, ctx: StepContext, cache: PagedKVCache) -> torch.Tensor:
        """Logits [R, V] at ctx.logit_rows (every row when None); writes the step's K/V into cache."""
        cos, sin = self.rope(ctx)  # gathered once for all layers (None without rope)
        x, pending = self.embed_tokens(ctx.input_ids), None
        for layer, k_pages, v_pages in zip(self.layers, cache.k, cache.v):
            x, pending = layer(x, pending, cos, sin, ctx, k_pages, v_pages)
        x = logit_rows(x, ctx)
        if pending is not None:
            x = x + logit_rows(pending, ctx)
        return self.lm_head(self.norm(x))
