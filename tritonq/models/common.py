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
      max_position, num_context_tokens  host ints (largest position, sum of context_lens), so
                               models need no device read to size rope tables or MLA's expansion.
      num_seqs     int or None a decode step padded to a batch bucket (tritonq.engine.cuda_graphs):
                               only its first num_seqs rows are sequences; the rest are padding
                               (slot -1, context length 0) whose outputs are ignored. None: no padding.

A model's forward(ctx, cache) writes each layer's new K/V into its pages, attends, and returns
logits [R, V] (or [T, V]) in the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonq.kernels.norm_rope import rope_cos_sin


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
    max_position: int  # the largest position in the step (host int: rope tables grow without a device read)
    num_context_tokens: int  # sum of context_lens (host int: MLA's prefill expands that many K/V rows)
    num_seqs: int | None = None  # padded decode step: its real rows (the rest are padding); None: all real


@dataclass(frozen=True)
class PagedKVCache:
    """Per layer k pages [num_blocks, block_size, Hkv, Dqk] and v pages [num_blocks, block_size, Hkv, Dv].

    Pages are shared by all sequences; a sequence's block_table names its pages. With a latent
    (MLA) cache, v is a strided view of k (v = k[..., :Dv]): the latent is stored once."""
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


@dataclass(frozen=True)
class KVLayout:
    """What one layer's cache holds per token: Hkv heads of Dqk (k) and Dv (v) values; v_in_k: v is
    the first Dv values of k (MLA's latent), so only k is allocated."""
    num_layers: int
    num_kv_heads: int
    d_qk: int
    d_v: int
    v_in_k: bool = False

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV-cache bytes one token costs across all layers."""
        per_head = self.d_qk if self.v_in_k else self.d_qk + self.d_v
        return self.num_layers * self.num_kv_heads * per_head * torch.empty((), dtype=dtype).element_size()

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> PagedKVCache:
        """Zeroed pages for num_blocks blocks of block_size tokens in every layer."""
        def pages(dim: int) -> torch.Tensor:
            return torch.zeros(num_blocks, block_size, self.num_kv_heads, dim, dtype=dtype, device=device)
        k = tuple(pages(self.d_qk) for _ in range(self.num_layers))
        if self.v_in_k:
            return PagedKVCache(k=k, v=tuple(t[..., :self.d_v] for t in k))
        return PagedKVCache(k=k, v=tuple(pages(self.d_v) for _ in range(self.num_layers)))


class RopeTables:
    """cos / sin rows at a step's positions, from tables built once and grown by doubling.

    Dynamic NTK scaling depends on the longest position (as transformers applies it per forward),
    so its tables are rebuilt for each step's largest position instead of cached."""

    def __init__(self, head_dim: int, base: float, scaling: dict | None, max_position_embeddings: int,
                 device: torch.device, dtype: torch.dtype):
        self.head_dim, self.base, self.scaling = head_dim, base, scaling
        self.max_position_embeddings, self.device, self.dtype = max_position_embeddings, device, dtype
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        self.dynamic = kind == "dynamic"
        self._size, self._cos, self._sin = 0, None, None

    def __call__(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, T, D] in the compute dtype: rows at ctx.positions, shaped for apply_rope."""
        needed = ctx.max_position + 1
        if self.dynamic:
            cos, sin = rope_cos_sin(self.head_dim, self.base, needed, self.scaling,
                                    self.max_position_embeddings, self.device)
        else:
            if needed > self._size:
                self._size = max(needed, 2 * self._size, 256)
                self._cos, self._sin = rope_cos_sin(self.head_dim, self.base, self._size, self.scaling,
                                                    self.max_position_embeddings, self.device)
            cos, sin = self._cos, self._sin
        return cos[ctx.positions].to(self.dtype)[None], sin[ctx.positions].to(self.dtype)[None]


def logit_rows(x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """The hidden rows whose logits are wanted: x [T, D] -> [R, D] (all of x when ctx.logit_rows is None)."""
    return x if ctx.logit_rows is None else x[ctx.logit_rows]
