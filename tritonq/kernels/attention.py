"""Attention over a paged KV cache: causal prefill (flash-attention 2) and split-KV decode
(flash-decoding), with GQA, and the write of new keys into the pages.

The cache is paged, as vLLM's PagedAttention: pages [P, page_size, Hkv, D] shared by all sequences
and a block table [B, max_pages] int32 mapping position n of sequence b to page
block_table[b, n // page_size], row n % page_size. page_size is a power of two >= 16 so a decode
key tile never spans two pages. Shapes (T new tokens, B sequences, H query heads, Hkv key/value
heads, H % Hkv == 0):
  write_kv_slots(k_pages, v_pages, k [T,Hkv,Dqk], v [T,Hkv,Dv], slot_mapping [T] int64)
      token t to page slot // page_size, row slot % page_size; slot < 0 skipped (padding).
  paged_prefill_attention(q [T,H,Dqk], k_pages, v_pages, cu_seqlens_q [B+1] int32,
                          context_lens [B] int32, block_table, scale, window=0) -> [T,H,Dv]
      packed varlen queries (the last q_len_b positions of each sequence) against the sequence's
      keys 0..context_lens[b]-1 (cached prefix + the new tokens, written first), causal.
  decode_attention(q [B,H,Dqk], k_pages, v_pages, cache_lens [B] int32, block_table, scale,
                   window=0) -> [B,H,Dv]
      one query per sequence against positions 0..cache_lens[b]-1 (the new token's included).
Sliding window (window > 0): key j is visible to query p iff j <= p and p - j < window,
transformers' convention; key blocks wholly outside are not loaded.
Attention sinks (gpt-oss; sinks [H] fp32, optional): head h's learned logit sinks[h] joins the softmax
denominator only, as a key with a zero value row would: out = sum_j e^(s_j) v_j / (e^(sinks[h]) +
sum_j e^(s_j)). Prefill starts each row's online softmax from that virtual key (running max sinks[h],
sum 1); decode adds it once, in the merge of the KV splits, so the splits themselves are unchanged.
ALiBi (alibi_slopes [H] fp32, keyword-only, MPT): query head h's score of key j at query position p gains
slopes[h] * (j - p) after the scale (softmax ignores the per-row constant, so this equals MPT's slopes * j).
dtypes: fp16, bf16 or fp32 (all inputs the same); accumulation and softmax are fp32; outputs are
in q's dtype (fp32 inputs use TF32 tensor-core dots on GPUs).

Head dims need not be powers of two and Dqk may differ from Dv (DeepSeek-V2: 192 / 128; its
absorbed-MLA decode: 576 / 512). Tensors are never padded in memory: the kernels hold each head
dim in power-of-two register blocks and mask the lanes past D (masked lanes are not loaded, so
memory traffic is unaffected). The qk dim is split into the largest power of two plus a
power-of-two tail, accumulated by two tl.dots into one score tile (`qk_blocks`): 192 = 128 + 64,
96 = 64 + 32 and 576 = 512 + 64 waste nothing; a ragged tail such as 72 = 64 + (8 -> 16) runs
its masked lanes through the dot. Dv is one block of next_pow2(Dv): 128 and 512 cost nothing,
while e.g. Dv = 96 pads to 128, i.e. 33% extra PV FLOPs, accumulator registers and V tile
shared memory.

Quantized KV cache (`QuantizedPages`, kv_cache_dtype "fp8" / "int8" in tritonq.load): pages hold 8-bit
values and a scale (value = page x scale), 1 byte per element instead of 2:
  fp8   float8_e4m3fn pages, one fp32 scale per tensor (per layer, for k and for v; the checkpoint's
        self_attn.k_scale / v_scale, else 1.0 as vLLM does). The kernels read and write the bytes with
        integer ops (`common.e4m3_bits_to_fp16` / `e4m3_bits_from_fp32`, exact), so sm_75 / sm_80, where
        Triton has no e4m3 type, run the same kernels as sm_89 / sm_90.
  int8  int8 pages and fp32 scales [P, page_size, Hkv] beside them, one per token and kv head:
        scale = absmax(row) / 127, values rounded half up (floor(x / scale + 0.5)). A cache whose
        k and v share one scale tensor (MLA's latent, v = k[..., :Dv]) takes one scale for both rows.
write_kv_slots quantizes; the attention kernels load the 8-bit tile, convert it to the dot's dtype
(exact: |int8| <= 127 and every e4m3 value are fp16 / bf16 values) and apply the scales in registers
to what they multiply: per-key scales to the score columns (k) and to the probabilities before the PV
dot (v); fp8's per-tensor scales once, to qk_scale and to the output. Without QuantizedPages the
kernels compile exactly as before (KV_FP8 / KV_INT8 False, no scale pointers).

On CPU tensors (unless TRITON_INTERPRET=1) the CPU backend runs instead: torch's fused CPU attention
over each sequence's real keys and an index_copy_ of the new keys (kernels/cpu_attention.py).
TRITONQ_BACKEND=torch runs the torch references (float32 compute), the test oracle.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tritonq.kernels import cpu_attention, use_cpu_kernels, use_triton
from tritonq.kernels.common import (
    E4M3_TO_FP16_BIAS,
    Launch,
    check_launch_config,
    compute_capability,
    e4m3_bits_from_fp32,
    e4m3_bits_to_fp16,
    ieee_dot,
    tuned_or_default,
)

LOG2E = 1.4426950408889634
KV_INT8_MAX = 127.0  # int8 KV codes are symmetric, -127 .. 127
KV_FP8_MAX = 448.0  # largest finite float8_e4m3fn: fp8 KV values saturate there
KV_SCALE_EPS = 1e-10  # floor on an int8 row's absmax, so an all-zero row gets a finite scale (and codes 0)
_KV_INT8_MAX = tl.constexpr(KV_INT8_MAX)  # the same numbers as seen from inside @triton.jit
_KV_FP8_MAX = tl.constexpr(KV_FP8_MAX)
_KV_SCALE_EPS = tl.constexpr(KV_SCALE_EPS)


@dataclass(frozen=True)
class QuantizedPages:
    """One layer's k (or v) pages in 8 bits with the scales that dequantize them: value = data x scale.

    data [P, page_size, Hkv, D]: float8_e4m3fn with scale [] fp32 (per tensor), or int8 with scale
    [P, page_size, Hkv] fp32 contiguous (per token and kv head, written with the values). MLA's latent
    v is QuantizedPages(k.data[..., :Dv], k.scale): the same scale tensor, so k and v share it.
    Passed wherever the kernels take k_pages / v_pages; models pass them on without looking inside."""
    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


def dequantize_pages(pages: torch.Tensor | QuantizedPages) -> torch.Tensor:
    """Plain torch: QuantizedPages -> float32 values [P, page_size, Hkv, D] (data x scale); plain pages as they are."""
    if not isinstance(pages, QuantizedPages):
        return pages
    scale = pages.scale if pages.scale.dim() == 0 else pages.scale[..., None]
    return pages.data.float() * scale


def read_kv_rows(pages: torch.Tensor | QuantizedPages, page_index: torch.Tensor, row_index: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """Rows pages[page_index, row_index] ([N, Hkv, D]) in dtype, dequantized from QuantizedPages (MLA's prefill
    reads the latent rows it expands this way)."""
    if not isinstance(pages, QuantizedPages):
        return pages[page_index, row_index].to(dtype)
    scale = pages.scale if pages.scale.dim() == 0 else pages.scale[page_index, row_index][..., None]
    return (pages.data[page_index, row_index].float() * scale).to(dtype)


@triton.jit
def _attend_tile(q, q_tail, k_rows, v_rows, key_ok, visible, m_i, l_i, acc, offs_d, offs_dr, offs_dv,
                 D_QK, D_V, qk_scale, BLOCK_DR: tl.constexpr, k_scale_ptr=None, v_scale_ptr=None, scale_rows=None,
                 KV_FP8: tl.constexpr = False, KV_INT8: tl.constexpr = False, bias=None):
    """One online-softmax step (flash-attention 2) of a query tile over BLOCK_N keys; every kernel's loop body.

    q [M, BLOCK_D] (and q_tail [M, BLOCK_DR] if BLOCK_DR > 0): the query tile, scale not applied.
    k_rows / v_rows [BLOCK_N]: pointers to the keys' rows (head offset applied, head dim contiguous).
    key_ok [BLOCK_N]: keys that exist (others are not loaded: unused cache rows may hold NaN garbage).
    visible [M, BLOCK_N]: the scores kept (causal, window, length). qk_scale includes log2(e).
    m_i, l_i [M]: running max (log2 domain) and sum; acc [M, BLOCK_DV]. Returns (m_i, l_i, acc) updated.
    bias [M, BLOCK_N] fp32 or None: added to the scaled scores, in the log2 domain (ALiBi).
    A row that has seen no visible key yet (a sliding window's leading tiles) keeps m_i = -inf and
    gains nothing: its max is taken as 0 for the exponentials, so exp2(-inf) = 0 and no NaN appears.
    Quantized pages (module docstring): KV_FP8 tiles are e4m3 bytes (decoded to value / 256; the caller
    folds scale x 256 into qk_scale and the output), KV_INT8 tiles int8 codes whose per-key scales
    [BLOCK_N] are read at k_scale_ptr / v_scale_ptr + scale_rows.
    """
    k = tl.load(k_rows[None, :] + offs_d[:, None], mask=key_ok[None, :] & (offs_d[:, None] < D_QK), other=0.0)
    s = ieee_dot(q, _kv_tile(k, q.dtype, KV_FP8), None)
    if BLOCK_DR > 0:
        k_tail = tl.load(k_rows[None, :] + offs_dr[:, None], mask=key_ok[None, :] & (offs_dr[:, None] < D_QK),
                         other=0.0)
        s = ieee_dot(q_tail, _kv_tile(k_tail, q.dtype, KV_FP8), s)
    if KV_INT8:  # each key's scale multiplies its score column (exact: the codes entered the dot unscaled)
        s = s * (tl.load(k_scale_ptr + scale_rows, mask=key_ok, other=0.0) * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if bias is not None:
        s += bias
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=key_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    if KV_INT8:  # each value row's scale multiplies its probability column: [M, BLOCK_N] products, not [BLOCK_N, Dv]
        l_i = l_i * alpha + tl.sum(p, 1)  # first, so that the scaled p replaces p (128-row tiles spilled otherwise)
        p = p * tl.load(v_scale_ptr + scale_rows, mask=key_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + ieee_dot(p.to(q.dtype), v.to(q.dtype), None)
    else:
        acc = acc * alpha[:, None] + ieee_dot(p.to(q.dtype), _kv_tile(v, q.dtype, KV_FP8), None)
        l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _kv_tile(x, dtype, KV_FP8: tl.constexpr):
    """A loaded K/V tile in the dot's dtype: e4m3 bytes decoded with integer ops (value / 256), int8 codes
    converted; both exact in fp16 / bf16 / fp32. Unquantized tiles are already in dtype."""
    if KV_FP8:
        x = e4m3_bits_to_fp16(x)
    return x.to(dtype)


@triton.jit
def _load_q(q_rows, row_ok, D_QK, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr):
    """q_rows [M] row pointers -> (q [M, BLOCK_D], q_tail [M, BLOCK_DR] or q again if BLOCK_DR == 0,
    offs_d, offs_dr): the qk head dim as a main block plus a tail block at offset BLOCK_D."""
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D_QK), other=0.0)
    if BLOCK_DR > 0:
        offs_dr = BLOCK_D + tl.arange(0, BLOCK_DR)
        q_tail = tl.load(q_rows[:, None] + offs_dr[None, :], mask=row_ok[:, None] & (offs_dr[None, :] < D_QK),
                         other=0.0)
    else:  # unused placeholders: _attend_tile reads them only when BLOCK_DR > 0
        offs_dr = offs_d
        q_tail = q
    return q, q_tail, offs_d, offs_dr


@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, cu_seqlens_ptr, context_lens_ptr, block_table_ptr, work_ptr,
                          stride_qt, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                          stride_ot, stride_oh, stride_bt, NUM_WORK, H, D_QK, D_V, qk_scale, window,
                          GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr,
                          BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, sinks_ptr=None,
                          HAS_SINKS: tl.constexpr = False, k_scale_ptr=None, v_scale_ptr=None,
                          KV_FP8: tl.constexpr = False, KV_INT8: tl.constexpr = False, alibi_ptr=None,
                          HAS_ALIBI: tl.constexpr = False):
    """One program: BLOCK_M consecutive new tokens of one sequence, one query head, over paged keys.

    work [2, NUM_WORK] int32 (built by the launcher on the device, no host sync): the sequence of
    each query block (-1: none, the grid is an upper bound) and its first query row in that sequence.
    Query row i of sequence b is at position ctx - q_len + i; keys 0..ctx-1 live in the pages of
    block_table[b]. Each key of a tile looks up its own page (BLOCK_N int loads, from cache), so
    key tiles may be longer than a page: 16-token pages still get 64-key tiles.
    HAS_SINKS: sinks_ptr [H] fp32; each row's softmax starts from the sink (max = its logit, sum = 1,
    nothing accumulated), a key whose value row is zero.
    KV_FP8 / KV_INT8: quantized pages with their scales (module docstring).
    HAS_ALIBI: score of key n for the query at position p gains alibi[h] * (n - p) (alibi: slopes * log2 e).
    """
    seq = tl.load(work_ptr + tl.program_id(0))
    first_row = tl.load(work_ptr + NUM_WORK + tl.program_id(0))
    h = tl.program_id(1)
    kv_h = h // GROUP
    b = tl.maximum(seq, 0)
    q_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.where(seq >= 0, tl.load(cu_seqlens_ptr + b + 1) - q_start, 0)
    ctx = tl.load(context_lens_ptr + b)

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    # Rows past the sequence's queries take its last position, so every row has a visible key.
    pos = tl.minimum(ctx - q_len + rows, ctx - 1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_rows = q_ptr + (q_start + rows).to(tl.int64) * stride_qt + h * stride_qh
    q, q_tail, offs_d, offs_dr = _load_q(q_rows, row_ok, D_QK, BLOCK_D, BLOCK_DR)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # log2 domain, as m_i: the sink's logit times log2(e) (qk_scale carries it for scores)
        m_i = tl.full([BLOCK_M], 1.0, tl.float32) * (tl.load(sinks_ptr + h) * 1.4426950408889634)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if KV_FP8:  # per-tensor k scale (and the decode's 2^-8) on every score
        qk_scale = qk_scale * tl.load(k_scale_ptr) * E4M3_TO_FP16_BIAS
    # Keys up to the block's last real row (causal); none if the program has no rows.
    hi = tl.where(first_row < q_len, tl.minimum(ctx, ctx - q_len + first_row + BLOCK_M), 0)
    first_key = 0  # the oldest key any row of the block sees
    if HAS_WINDOW:
        first_key = tl.maximum(ctx - q_len + first_row - window + 1, 0)
    # Keys before first_key are never loaded, nor their table entries: with a window, the engine may
    # free (and reuse, or mark -1) pages that every query has left behind.
    for start_n in range(first_key // BLOCK_N * BLOCK_N, hi, BLOCK_N):
        n = start_n + offs_n
        key_ok = (n < ctx) & (n >= first_key)
        page = tl.load(block_table_ptr + b * stride_bt + n // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        page_rows = n % PAGE_SIZE
        visible = n[None, :] <= pos[:, None]
        if HAS_WINDOW:
            visible = visible & (pos[:, None] - n[None, :] < window)
        bias = None
        if HAS_ALIBI:
            bias = tl.load(alibi_ptr + h) * (n[None, :] - pos[:, None]).to(tl.float32)
        m_i, l_i, acc = _attend_tile(q, q_tail, k_ptr + page * stride_kp + kv_h * stride_kh + page_rows * stride_ks,
                                     v_ptr + page * stride_vp + kv_h * stride_vh + page_rows * stride_vs,
                                     key_ok, visible, m_i, l_i, acc, offs_d, offs_dr, offs_dv, D_QK, D_V,
                                     qk_scale, BLOCK_DR, k_scale_ptr, v_scale_ptr,
                                     (page * PAGE_SIZE + page_rows) * (H // GROUP) + kv_h, KV_FP8, KV_INT8, bias)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * (tl.load(v_scale_ptr) * E4M3_TO_FP16_BIAS)
    tl.store(o_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < D_V))


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, cache_lens_ptr, block_table_ptr, part_o_ptr, part_lse_ptr,
                         stride_qb, stride_qh, stride_kp, stride_ks, stride_kh,
                         stride_vp, stride_vs, stride_vh, stride_bt, H, D_QK, D_V, qk_scale, window,
                         GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr,
                         BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                         k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False,
                         KV_INT8: tl.constexpr = False, alibi_ptr=None, HAS_ALIBI: tl.constexpr = False):
    """Stage 1. One program: one KV split of one (sequence, kv head, block of its query heads).

    All query heads sharing a kv head are one tl.dot operand, so each K/V tile is read once per
    kv head (GQA costs no extra bandwidth). Writes the split's normalized output to
    part_o [B, H, NUM_SPLITS, D_V] fp32 and its log2-sum-exp to part_lse [B, H, NUM_SPLITS].
    k/v are pages [P, PAGE_SIZE, Hkv, D] (PAGE_SIZE a multiple of BLOCK_N) and position n of sequence b
    lives in page block_table[b, n // PAGE_SIZE]; a key tile never straddles two pages, so paging costs
    one scalar load per tile.
    HAS_WINDOW: only keys >= cache_len - window exist for the query; the splits divide that range.
    KV_FP8 / KV_INT8: quantized pages with their scales (module docstring).
    HAS_ALIBI: key n's score gains alibi[head] * (n - (cache_len - 1)) (alibi: slopes * log2 e).
    """
    b = tl.program_id(0)
    head_blocks = tl.cdiv(GROUP, BLOCK_H)
    kv_h = tl.program_id(1) // head_blocks
    group_offs = (tl.program_id(1) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    heads = kv_h * GROUP + group_offs
    head_mask = group_offs < GROUP
    split = tl.program_id(2)
    cache_len = tl.load(cache_lens_ptr + b)
    first = 0  # the first key the query sees, and that rounded down to a key block
    start = 0
    if HAS_WINDOW:
        first = tl.maximum(cache_len - window, 0)
        start = first // BLOCK_N * BLOCK_N
    # Split boundaries are BLOCK_N-aligned; trailing splits of a short sequence are empty.
    split_len = tl.cdiv(tl.cdiv(cache_len - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, cache_len)

    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    q, q_tail, offs_d, offs_dr = _load_q(q_ptr + b * stride_qb + heads * stride_qh, head_mask, D_QK,
                                         BLOCK_D, BLOCK_DR)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    if KV_FP8:  # per-tensor k scale (and the decode's 2^-8) on every score
        qk_scale = qk_scale * tl.load(k_scale_ptr) * E4M3_TO_FP16_BIAS
    slopes = None
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=head_mask, other=0.0)
    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        page = tl.load(block_table_ptr + b * stride_bt + start_n // PAGE_SIZE).to(tl.int64)
        rows = start_n % PAGE_SIZE + offs_n  # the tile's rows in its page
        key_ok = (n < hi) & (n >= first)
        bias = None
        if HAS_ALIBI:
            bias = slopes[:, None] * (n - (cache_len - 1)).to(tl.float32)[None, :]
        m_i, l_i, acc = _attend_tile(q, q_tail, k_ptr + page * stride_kp + kv_h * stride_kh + rows * stride_ks,
                                     v_ptr + page * stride_vp + kv_h * stride_vh + rows * stride_vs, key_ok,
                                     key_ok[None, :], m_i, l_i, acc, offs_d, offs_dr,
                                     offs_dv, D_QK, D_V, qk_scale, BLOCK_DR, k_scale_ptr, v_scale_ptr,
                                     (page * PAGE_SIZE + rows) * (H // GROUP) + kv_h, KV_FP8, KV_INT8, bias)

    # An empty split stores lse = -inf and a zero output; the merge gives it weight 0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if KV_FP8:
        out = out * (tl.load(v_scale_ptr) * E4M3_TO_FP16_BIAS)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    row = (b * H + heads) * NUM_SPLITS + split
    tl.store(part_o_ptr + row[:, None] * D_V + offs_dv[None, :], out,
             mask=head_mask[:, None] & (offs_dv[None, :] < D_V))
    tl.store(part_lse_ptr + row, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(part_o_ptr, part_lse_ptr, o_ptr, stride_ob, stride_oh, H, D_V,
                         NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
                         BLOCK_DV: tl.constexpr, sinks_ptr, HAS_SINKS: tl.constexpr = False):
    """Stage 2. One program per (sequence, query head): log-sum-exp weighted sum of the splits.
    HAS_SINKS: the head's sink (sinks_ptr [H] fp32) is one more split with a zero output: it adds
    only to the total weight."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = (b * H + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    part = tl.load(part_o_ptr + row[:, None] * D_V + offs_dv[None, :],
                   mask=(offs_s[:, None] < NUM_SPLITS) & (offs_dv[None, :] < D_V), other=0.0)
    # A sequence with no keys (context length 0: a padding row of a CUDA-graph bucket) has every split
    # empty (lse -inf): its output is 0, not the NaN of -inf - -inf, so nothing non-finite can leak.
    top = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h) * 1.4426950408889634  # log2 domain, as lse
        top = tl.maximum(top, sink)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(weight, 0)
    if HAS_SINKS:  # top >= sink is finite here
        total += tl.exp2(sink - top)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_dv, out.to(o_ptr.dtype.element_ty),
             mask=offs_dv < D_V)


@triton.jit
def _write_slots_kernel(k_pages_ptr, v_pages_ptr, k_ptr, v_ptr, slot_ptr,
                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                        stride_kt, stride_kth, stride_vt, stride_vth, D_QK, D_V,
                        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
                        k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False,
                        KV_INT8: tl.constexpr = False, SHARED_SCALE: tl.constexpr = False):
    """One program copies the k and v rows of one (token, kv head) to its slot; a slot < 0 writes nothing.

    KV_FP8: the rows are divided by the per-tensor scales and stored as e4m3 bytes (saturating at +-448).
    KV_INT8: each row gets scale = absmax / 127 (SHARED_SCALE: one for k and v, the larger absmax),
    stored at scales[slot, head], and codes floor(x / scale + 0.5)."""
    t = tl.program_id(0).to(tl.int64)  # t x stride_kt: past 2^31 elements for MLA prefill's long contexts
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    page, row = slot // PAGE_SIZE, slot % PAGE_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # slot is broadcast to a vector first because the interpreter rejects scalar & vector masks.
    k = tl.load(k_ptr + t * stride_kt + h * stride_kth + offs_d, mask=offs_d < D_QK, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vth + offs_dv, mask=offs_dv < D_V, other=0.0)
    if KV_FP8:
        k = e4m3_bits_from_fp32(tl.clamp(tl.math.div_rn(k.to(tl.float32), tl.zeros([BLOCK_D], tl.float32)
                                                        + tl.load(k_scale_ptr)), -_KV_FP8_MAX, _KV_FP8_MAX))
        v = e4m3_bits_from_fp32(tl.clamp(tl.math.div_rn(v.to(tl.float32), tl.zeros([BLOCK_DV], tl.float32)
                                                        + tl.load(v_scale_ptr)), -_KV_FP8_MAX, _KV_FP8_MAX))
    if KV_INT8:
        k_absmax = tl.max(tl.abs(k.to(tl.float32)), 0)
        v_absmax = tl.max(tl.abs(v.to(tl.float32)), 0)
        if SHARED_SCALE:  # MLA's latent: v is k's first D_V values, stored once under one scale
            k_absmax = tl.maximum(k_absmax, v_absmax)
            v_absmax = k_absmax
        k_scale = tl.maximum(k_absmax, _KV_SCALE_EPS) / _KV_INT8_MAX
        v_scale = tl.maximum(v_absmax, _KV_SCALE_EPS) / _KV_INT8_MAX
        # div_rn: Triton's fp32 `/` is approximate on NVIDIA, and a code must not depend on that rounding
        k = tl.clamp(tl.floor(tl.math.div_rn(k.to(tl.float32), tl.zeros([BLOCK_D], tl.float32) + k_scale) + 0.5),
                     -_KV_INT8_MAX, _KV_INT8_MAX).to(tl.int8)
        v = tl.clamp(tl.floor(tl.math.div_rn(v.to(tl.float32), tl.zeros([BLOCK_DV], tl.float32) + v_scale) + 0.5),
                     -_KV_INT8_MAX, _KV_INT8_MAX).to(tl.int8)
        scale_row = slot * tl.num_programs(1) + h  # scales [P, PAGE_SIZE, Hkv] contiguous: slot x Hkv + head
        tl.store(k_scale_ptr + scale_row, k_scale, mask=slot >= 0)
        tl.store(v_scale_ptr + scale_row, v_scale, mask=slot >= 0)
    tl.store(k_pages_ptr + page * stride_kp + row * stride_ks + h * stride_kh + offs_d, k,
             mask=(offs_d < D_QK) & (slot + 0 * offs_d >= 0))
    tl.store(v_pages_ptr + page * stride_vp + row * stride_vs + h * stride_vh + offs_dv, v,
             mask=(offs_dv < D_V) & (slot + 0 * offs_dv >= 0))


@dataclass(frozen=True)
class PrefillConfig:
    """Launch config of _paged_prefill_kernel; tuned JSON (attention_prefill) stores the same fields."""
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeConfig:
    """Launch config of _decode_split_kernel. Tuned JSON stores BLOCK_N, num_warps, num_stages;
    NUM_SPLITS depends on batch and cache length, so it is always derived (`fit_decode_config`)."""
    BLOCK_N: int
    NUM_SPLITS: int
    num_warps: int
    num_stages: int


def qk_blocks(d_qk: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DR): the largest power of two <= d_qk plus a power-of-two tail block (0 if
    none). 192 = 128 + 64, 96 = 64 + 32, 576 = 512 + 64 waste nothing; 72 = 64 + 16 masks 8 lanes.
    Blocks are at least 16 wide, the smallest tl.dot operand."""
    main = max(16, 1 << (d_qk.bit_length() - 1))
    return main, (max(16, triton.next_power_of_2(d_qk - main)) if d_qk > main else 0)


def config_bucket(block_d: int, block_dr: int, block_dv: int) -> str:
    """Key of the tuned attention_prefill / attention_decode JSON: the head-dim register blocks."""
    return f"D{block_d}+{block_dr}_DV{block_dv}"


def paged_prefill_config(block_d: int, block_dr: int, block_dv: int, cc: int | None) -> PrefillConfig:
    """Tuned config of _paged_prefill_kernel for these head-dim blocks on this GPU (compute capability
    cc), else the default in code; cc None means the interpreter: 16 x 16 tiles, so that small test
    shapes still span several blocks and tails.

    Defaults (0 spills in AOT compiles at the launch's real divisibility hints and GQA, 32 / 8 heads;
    MLA 16 / 1): 128 query rows up to DeepSeek's 128 + 64 head dims, 64 for wider heads (256); 64-key
    tiles, but 32 before sm_90 above 64-wide heads (the per-key page gather's registers: 64 keys spill
    28 bytes at 128 / 128 and 80 at 256 / 256 on sm_80); MLA latent 576 / 512 heads a [16, 512] fp32
    accumulator as decode's, with 32-key tiles before sm_90 and 16 from sm_90 on (32 spill 4 bytes
    there with a window or 64-token pages).
    Before sm_80 (T4: 64 KB of shared memory per block; Triton 3.x lowers tl.dot to FMA there, no mma,
    and has no cp.async to pipeline): 64 query rows (32 for 256-wide heads), 16-key tiles, one stage:
    41-57 KB, no spills at head dims 64-192 (tests/test_fit.py); 128-row tiles need 80-112 KB. No
    tile fits MLA's latent 576 / 512 there: the [16, 512] query and accumulator alone take 68 KB.
    """
    if cc is None:
        return PrefillConfig(16, 16, 1, 1)
    if cc < 80 and block_dv <= 256:
        narrow_heads = block_d + block_dr <= 192 and block_dv <= 128
        default = PrefillConfig(64 if narrow_heads else 32, 16, 8, 1)
    elif block_dv > 256:
        default = PrefillConfig(16, 32 if cc < 90 else 16, 8, 2)
    else:
        block_n = 64 if cc >= 90 or block_d + block_dr <= 64 else 32
        narrow_heads = block_d + block_dr <= 192 and block_dv <= 128
        default = PrefillConfig(128 if narrow_heads else 64, block_n, 8, 3 if narrow_heads else 2)
    return tuned_or_default("attention_prefill", config_bucket(block_d, block_dr, block_dv), default)


def decode_config(batch: int, kv_heads: int, max_len: int, page_size: int, block_d: int, block_dr: int,
                  block_dv: int, sm_count: int | None) -> DecodeConfig:
    """The decode launch config over pages of page_size: the tuned (else default) key tile, capped by
    `paged_block_n`, and splits so that batch x kv_heads x splits programs fill about two waves of
    sm_count SMs.

    Chosen from the cache capacity (not cache_lens, which live on the device) so the launch needs
    no host sync and stays CUDA-graph friendly; each split keeps at least 4 key tiles.
    sm_count None means the interpreter: 16-token tiles and up to 4 splits, so that small test
    caches span several tiles, several splits and empty splits.
    """
    if sm_count is None:
        return fit_decode_config(DecodeConfig(16, 1, 1, 1), batch, kv_heads, max_len, page_size, None)
    # 32-key tiles (the most a page lookup allows, `paged_block_n`); 256-wide and MLA latent 576 / 512
    # values need 8 warps for their [16, Dv] fp32 accumulator.
    default = DecodeConfig(32, 1, 8 if block_dv > 128 else 4, 2)
    cfg = tuned_or_default("attention_decode", config_bucket(block_d, block_dr, block_dv), default)
    return fit_decode_config(cfg, batch, kv_heads, max_len, page_size, sm_count)


def paged_block_n(block_n: int, page_size: int) -> int:
    """The decode key tile: within one page, and at most 32 keys, since the per-key page lookup costs
    registers (sm_80, Dqk 128: 64-key tiles over 64-token pages spill 92 registers, 32-key tiles none)."""
    return min(block_n, page_size, 32)


def fit_decode_config(cfg: DecodeConfig, batch: int, kv_heads: int, max_len: int, page_size: int,
                      sm_count: int | None) -> DecodeConfig:
    """cfg with the key tile launched over pages of page_size (`paged_block_n`) and NUM_SPLITS derived
    (cfg's own is ignored): about two waves of programs on sm_count SMs, >= 4 key tiles per split; the
    interpreter (sm_count None) takes up to 4 splits."""
    block_n = paged_block_n(cfg.BLOCK_N, page_size)
    if sm_count is None:
        splits = min(4, triton.cdiv(max_len, block_n))
    else:
        wanted = triton.cdiv(2 * sm_count, batch * kv_heads)
        splits = max(1, min(wanted, triton.cdiv(max_len, 4 * block_n), 64))
    return replace(cfg, BLOCK_N=block_n, NUM_SPLITS=splits)


def check_prefill_config(config: PrefillConfig) -> None:
    """TypeError/ValueError unless `config` is a launchable PrefillConfig."""
    check_launch_config("paged_prefill_attention", config, PrefillConfig)


def check_decode_config(config: DecodeConfig, page_size: int) -> None:
    """TypeError/ValueError unless `config` is a launchable DecodeConfig with BLOCK_N <= page_size."""
    check_launch_config("decode_attention", config, DecodeConfig)
    if config.BLOCK_N > page_size:
        raise ValueError(f"decode_attention: config.BLOCK_N = {config.BLOCK_N} exceeds the KV cache page size "
                         f"{page_size}; a key tile must lie in one page, so use BLOCK_N <= {page_size}")


def _check_lens(name: str, lens: torch.Tensor, batch: int, device: torch.device) -> None:
    if lens.dtype != torch.int32 or lens.shape != (batch,) or lens.device != device:
        raise ValueError(f"{name} must be an int32 tensor of shape [{batch}] on {device}; got "
                         f"{lens.dtype} {tuple(lens.shape)} on {lens.device}. "
                         f"Use torch.tensor(lengths, dtype=torch.int32, device=q.device).")


def _check_block_table(block_table: torch.Tensor, k_cache: torch.Tensor, batch: int, device: torch.device) -> int:
    """The page size of a paged cache (k_cache [P, page_size, Hkv, D]) after checking its block table."""
    page_size = k_cache.shape[1]
    if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2
            or block_table.shape[0] != batch or block_table.device != device):
        found = (f"{block_table.dtype} {tuple(block_table.shape)} on {block_table.device}"
                 if isinstance(block_table, torch.Tensor) else repr(block_table))
        raise ValueError(f"block_table must be an int32 tensor [{batch}, max_pages] on {device}; got {found}.")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"paged KV cache: page_size (k_cache.shape[1]) = {page_size}; expected a power of two "
                         ">= 16 (a key tile must fit in one page). vLLM's default is 16.")
    return page_size


def _check_slots(slot_mapping: torch.Tensor, capacity: int) -> None:
    """Every slot < capacity (num_blocks x block_size; < 0 skips): a ValueError on CPU (the values are on the
    host already: reading them syncs nothing), a device-side assert elsewhere (a host check would sync the
    GPU, and break graph capture)."""
    expected = f"write_kv_slots: slots must be < num_blocks x block_size = {capacity} (or < 0 to skip)"
    if slot_mapping.device.type != "cpu":
        torch._assert_async(slot_mapping.max() < capacity, expected)
    elif int(slot_mapping.max()) >= capacity:
        raise ValueError(f"{expected}; got {int(slot_mapping.max())}.")


def _check_prefill_lens(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, T: int, capacity: int) -> None:
    """cu_seqlens_q rises from 0 to T and q_len_b <= context_lens[b] <= capacity (the block table's tokens):
    a ValueError on CPU (the values are on the host), a device-side assert on CUDA (a host check would sync)."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    consistent = ((cu_seqlens_q[0] == 0) & (cu_seqlens_q[-1] == T) & (q_lens >= 0).all()
                  & (context_lens >= q_lens).all() & (context_lens <= capacity).all())
    expected = (f"paged_prefill_attention: expected cu_seqlens_q rising from 0 to T = {T} and "
                f"q_len_b <= context_lens[b] <= block_table width x page_size = {capacity}")
    if cu_seqlens_q.device.type != "cpu":
        torch._assert_async(consistent, expected)
    elif not bool(consistent):
        raise ValueError(f"{expected}; got cu_seqlens_q {cu_seqlens_q.tolist()}, context_lens "
                         f"{context_lens.tolist()}. context_lens counts the cached prefix plus the new tokens.")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str, quantized: bool = False) -> None:
    # 8-bit pages (checked by _unpack_pages) dequantize into q's dtype
    page_dtypes_ok = quantized or q.dtype == k.dtype == v.dtype
    if not page_dtypes_ok or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}. Cast them (or the KV cache) to the model dtype.")
    H, Hkv = q.shape[-2], k.shape[2]
    if k.shape[2] != v.shape[2] or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads, and k and v must have the "
                         f"same kv heads; got k {tuple(k.shape)}, v {tuple(v.shape)} ({what}).")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)} ({what}).")


def _check_window(window) -> None:
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window = {window!r}; expected an int >= 0 (0: no sliding window).")


def _check_sinks(sinks, heads: int, device: torch.device) -> None:
    """sinks is None or a float32 [H] tensor on q's device (one logit per query head of this rank)."""
    if sinks is None:
        return
    if (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or sinks.shape != (heads,)
            or sinks.device != device):
        found = f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}" if isinstance(sinks, torch.Tensor) \
            else repr(sinks)
        raise ValueError(f"sinks must be a float32 tensor [{heads}] (one logit per query head) on {device}; got "
                         f"{found}. Convert once at load: sinks.float().contiguous().")


def _check_alibi(alibi_slopes: torch.Tensor | None, H: int, device: torch.device) -> None:
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) != (H,)
                                     or alibi_slopes.device != device or not alibi_slopes.is_contiguous()):
        raise ValueError(f"alibi_slopes is {alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}; "
                         f"expected a contiguous float32 [{H}] (one slope per query head) on {device} "
                         "(tritonq.kernels.attention.alibi_slopes builds MPT's)")


def alibi_slopes(num_heads: int, bias_max: float = 8.0, device=None) -> torch.Tensor:
    """MPT's ALiBi slopes [num_heads] fp32: 2^(-bias_max * i / n) for i = 1..n, n = num_heads rounded up to a
    power of two; for other head counts the odd-indexed slopes of that list, then the even ones, cut to
    num_heads (MPT's rule, as transformers' build_mpt_alibi_tensor)."""
    n = 1 << max(0, num_heads - 1).bit_length()
    slopes = 1.0 / torch.pow(2.0, torch.arange(1, n + 1, dtype=torch.float32, device=device) * (bias_max / n))
    if n != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes.contiguous()


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _unpack_pages(k_pages, v_pages, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                        torch.Tensor | None]:
    """(k data, v data, k scale, v scale) of a checked pair of pages: plain tensors (scales None) or
    QuantizedPages (module docstring); a ValueError naming what is wrong otherwise."""
    quantized = isinstance(k_pages, QuantizedPages), isinstance(v_pages, QuantizedPages)
    if not any(quantized):
        return k_pages, v_pages, None, None
    if not all(quantized):
        raise ValueError(f"{what}: k_pages and v_pages must both be QuantizedPages or both plain tensors; got "
                         f"{type(k_pages).__name__} and {type(v_pages).__name__}.")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        data, scale = pages.data, pages.scale
        if data.dim() != 4 or data.dtype not in (torch.int8, torch.float8_e4m3fn) or data.stride(-1) != 1:
            raise ValueError(f"{what}: {name}.data must be int8 or float8_e4m3fn pages [P, page_size, Hkv, D], "
                             f"contiguous in D; got {data.dtype} {tuple(data.shape)} strides {data.stride()}.")
        expected = () if data.dtype == torch.float8_e4m3fn else tuple(data.shape[:3])
        if (scale.dtype != torch.float32 or tuple(scale.shape) != expected or scale.device != data.device
                or not scale.is_contiguous()):
            kind = "per tensor, []" if not expected else f"per token and kv head, {list(expected)} contiguous"
            raise ValueError(f"{what}: {name}.scale must be float32 ({kind}) on {data.device} for {data.dtype} "
                             f"pages; got {scale.dtype} {tuple(scale.shape)} on {scale.device}.")
    if k_pages.data.dtype != v_pages.data.dtype:
        raise ValueError(f"{what}: k and v pages differ in dtype ({k_pages.data.dtype}, {v_pages.data.dtype}); "
                         "one KV cache dtype per layer.")
    return k_pages.data, v_pages.data, k_pages.scale, v_pages.scale


def _kv_launch_args(k_pages, v_pages) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The kernels' (k, v, quantization args) for plain or quantized pages: e4m3 pages travel as their bytes
    (uint8: the kernels decode them with integer ops on every GPU); no extra args for plain pages, so their
    launches are the same as before KV quantization existed."""
    if not isinstance(k_pages, QuantizedPages):
        return k_pages, v_pages, {}
    fp8 = k_pages.data.dtype == torch.float8_e4m3fn
    k, v = (p.data.view(torch.uint8) if fp8 else p.data for p in (k_pages, v_pages))
    return k, v, dict(k_scale_ptr=k_pages.scale, v_scale_ptr=v_pages.scale, KV_FP8=fp8, KV_INT8=not fp8)


def head_blocks(d_qk: int, d_v: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_DR, BLOCK_DV): the register blocks of the qk head dim (`qk_blocks`) and of the
    v head dim (a power of two >= 16); they key the tuned configs (`config_bucket`)."""
    return (*qk_blocks(d_qk), max(16, triton.next_power_of_2(d_v)))


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, cache_lens: torch.Tensor,
                     block_table: torch.Tensor, scale: float, window: int = 0, config: DecodeConfig | None = None,
                     max_seq_len: int | None = None, sinks: torch.Tensor | None = None, *,
                     alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged KV cache; see the module docstring.

    q [B, H, Dqk]; k_pages [P, page_size, Hkv, Dqk], v_pages [P, page_size, Hkv, Dv] (strided views
    allowed, e.g. MLA's v = k_pages[..., :512]); cache_lens [B] int32 counts each sequence's keys (the
    new token's included: write_kv_slots first); block_table [B, max_pages] int32: position n of
    sequence b is in page block_table[b, n // page_size]. Returns [B, H, Dv] in q's dtype.
    window > 0: sliding window, the query (at position cache_lens[b] - 1) sees the last `window` keys.
    config: launch config for the Triton kernels (the tuner's candidates; BLOCK_N <= page_size);
    None: `decode_config`. The key tile is `paged_block_n`: BLOCK_N capped at page_size and at 32.
    max_seq_len: the capacity the launch config is chosen for (default: the block table width x
    page_size). The config never depends on cache_lens, so a growing sequence never recompiles and
    the launch is CUDA-graph safe. sinks [H] float32: attention sinks (see the module docstring).
    the launch is CUDA-graph safe. k_pages / v_pages may be QuantizedPages (8-bit, dequantized in registers).
    the launch is CUDA-graph safe. alibi_slopes [H] fp32: ALiBi (module docstring); None: none.
    """
    given = k_pages, v_pages
    k_pages, v_pages, k_scale, v_scale = _unpack_pages(k_pages, v_pages, "decode_attention")
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.dim() != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"decode_attention: expected q [B,H,Dqk], k_pages [P,page_size,Hkv,Dqk], v_pages "
                         f"[P,page_size,Hkv,Dv]; got q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, "
                         f"v_pages {tuple(v_pages.shape)}.")
    _check_heads(q, k_pages, v_pages, "decode", k_scale is not None)
    B, H, D_QK = q.shape
    _check_lens("cache_lens", cache_lens, B, q.device)
    page_size = _check_block_table(block_table, k_pages, B, q.device)
    if config is not None:
        check_decode_config(config, page_size)
    _check_window(window)
    _check_sinks(sinks, H, q.device)
    _check_alibi(alibi_slopes, H, q.device)
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
        raise ValueError(f"decode_attention: max_seq_len = {max_seq_len!r}; expected an int >= 1 (the capacity "
                         "the launch config is chosen for) or None.")
    if use_cpu_kernels(q):  # torch's CPU flash attention over each sequence's real keys (kernels/cpu_attention.py)
        return cpu_attention.decode_attention(q, k_pages, v_pages, cache_lens, block_table, scale, window,
                                              k_scale, v_scale, sinks, alibi_slopes=alibi_slopes)
    if not use_triton(q):
        return decode_attention_reference(q, *given, cache_lens, block_table, scale, window, sinks,
                                          alibi_slopes=alibi_slopes)

    q = _last_dim_contiguous(q)
    if k_scale is None:
        k_pages, v_pages = map(_last_dim_contiguous, (k_pages, v_pages))
    else:  # 8-bit pages (contiguous in the head dim: _unpack_pages) travel with their scales
        k_pages, v_pages = given
    H_kv, D_V = k_pages.shape[2], v_pages.shape[-1]
    # The config depends on capacity only (never cache_lens): a growing sequence keeps one compiled
    # kernel and the launch reads nothing from the device. A window bounds the keys any query sees.
    S_max = max_seq_len or block_table.shape[1] * page_size
    if window:
        S_max = min(S_max, window)
    sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else None
    cfg = config or decode_config(B, H_kv, S_max, page_size, *head_blocks(D_QK, D_V), sm_count)
    split, merge, out = decode_launches(q, k_pages, v_pages, cache_lens, block_table, scale, window, cfg, sinks,
                                        alibi_slopes=alibi_slopes)
    split()
    merge()
    return out


def decode_launches(q: torch.Tensor, k_pages: torch.Tensor | QuantizedPages, v_pages: torch.Tensor | QuantizedPages,
                    cache_lens: torch.Tensor, block_table: torch.Tensor, scale: float, window: int,
                    cfg: DecodeConfig, sinks: torch.Tensor | None = None, *,
                    alibi_slopes: torch.Tensor | None = None) -> tuple[Launch, Launch, torch.Tensor]:
    """The two launches of a decode step (_decode_split_kernel, then _decode_merge_kernel) for checked
    inputs of decode_attention (head dim contiguous), and the output o [B, H, Dv]. Over meta tensors
    they are what tune --aot and the AOT tests compile. sinks [H] fp32 enter the merge only."""
    k_pages, v_pages, kv_args = _kv_launch_args(k_pages, v_pages)
    B, H, D_QK = q.shape
    H_kv, D_V = k_pages.shape[2], v_pages.shape[-1]
    group = H // H_kv
    block_d, block_dr, block_dv = head_blocks(D_QK, D_V)
    block_h = min(64, max(16, triton.next_power_of_2(group)))  # tl.dot needs >= 16 rows
    page_size = k_pages.shape[1]
    block_n = paged_block_n(cfg.BLOCK_N, page_size)  # a key tile within one page, <= 32 keys
    part_o = torch.empty(B, H, cfg.NUM_SPLITS, D_V, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H, cfg.NUM_SPLITS, dtype=torch.float32, device=q.device)
    split = dict(q_ptr=q, k_ptr=k_pages, v_ptr=v_pages, cache_lens_ptr=cache_lens, block_table_ptr=block_table,
                 part_o_ptr=part_o, part_lse_ptr=part_lse, stride_qb=q.stride(0), stride_qh=q.stride(1),
                 stride_kp=k_pages.stride(0), stride_ks=k_pages.stride(1), stride_kh=k_pages.stride(2),
                 stride_vp=v_pages.stride(0), stride_vs=v_pages.stride(1), stride_vh=v_pages.stride(2),
                 stride_bt=block_table.stride(0), H=H, D_QK=D_QK, D_V=D_V, qk_scale=scale * LOG2E, window=window,
                 GROUP=group, NUM_SPLITS=cfg.NUM_SPLITS, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
                 BLOCK_DR=block_dr, BLOCK_DV=block_dv, PAGE_SIZE=page_size, HAS_WINDOW=window > 0, **kv_args,
                 alibi_ptr=q if alibi_slopes is None else alibi_slopes * LOG2E, HAS_ALIBI=alibi_slopes is not None)
    out = torch.empty(B, H, D_V, dtype=q.dtype, device=q.device)
    block_splits = triton.next_power_of_2(cfg.NUM_SPLITS)
    merge = dict(part_o_ptr=part_o, part_lse_ptr=part_lse, o_ptr=out, stride_ob=out.stride(0),
                 stride_oh=out.stride(1), H=H, D_V=D_V, NUM_SPLITS=cfg.NUM_SPLITS, BLOCK_SPLITS=block_splits,
                 BLOCK_DV=block_dv, sinks_ptr=part_lse if sinks is None else sinks, HAS_SINKS=sinks is not None)
    # The merge holds all partial outputs [BLOCK_SPLITS, BLOCK_DV] fp32 at once: a warp per 4096 of them
    # keeps it at <= 128 per thread (MLA's 64 x 512 spills 5.4 KB with 4 warps on sm_90, none with 8: AOT).
    merge_warps = min(16, max(4, block_splits * block_dv // 4096))
    return (Launch(_decode_split_kernel, (B, H_kv * triton.cdiv(group, block_h), cfg.NUM_SPLITS), split,
                   cfg.num_warps, cfg.num_stages),
            Launch(_decode_merge_kernel, (B, H), merge, merge_warps, 1), out)  # one pass: nothing to pipeline


def write_kv_slots(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor, *, check_values: bool = True) -> None:
    """Scatter one step's new tokens into a paged cache, in place.

    k_pages [num_blocks, block_size, Hkv, Dqk], v_pages [num_blocks, block_size, Hkv, Dv] (v_pages
    may be a strided view, e.g. the MLA latent k_pages[..., :512]); k [T, Hkv, Dqk], v [T, Hkv, Dv];
    slot_mapping [T] int64: token t goes to page slot // block_size, row slot % block_size; a
    slot < 0 is skipped (padding, e.g. unused rows of a CUDA-graph bucket).
    check_values=False skips the check of the slots' values (a device reduction and assert on CUDA):
    for callers that checked them already, e.g. models, whose steps the engine's runner checks once
    on the host (every layer would otherwise repeat it). Shapes, dtypes and devices are always checked.
    QuantizedPages: k and v (in the model dtype) are quantized as they are written (module docstring).
    """
    given = k_pages, v_pages
    k_pages, v_pages, k_scale, v_scale = _unpack_pages(k_pages, v_pages, "write_kv_slots")
    if (k.dim() != 3 or v.dim() != 3 or k_pages.dim() != 4 or v_pages.dim() != 4 or k.shape[:2] != v.shape[:2]
            or k_pages.shape[:3] != v_pages.shape[:3] or k_pages.shape[2:] != k.shape[1:]
            or v_pages.shape[2:] != v.shape[1:]):
        raise ValueError(f"write_kv_slots: expected k [T,Hkv,Dqk], v [T,Hkv,Dv] matching k_pages "
                         f"[num_blocks,block_size,Hkv,Dqk], v_pages [num_blocks,block_size,Hkv,Dv]; got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, k_pages {tuple(k_pages.shape)}, "
                         f"v_pages {tuple(v_pages.shape)}.")
    if k_scale is not None:
        if k.dtype != v.dtype or k.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"write_kv_slots: k/v dtypes {k.dtype}/{v.dtype}; 8-bit pages take fp16/bf16/fp32 "
                             "k and v of one dtype (the model's), quantized as they are written.")
    elif k.dtype != k_pages.dtype or v.dtype != v_pages.dtype:
        raise ValueError(f"write_kv_slots: k/v dtypes {k.dtype}/{v.dtype} differ from the cache's "
                         f"{k_pages.dtype}/{v_pages.dtype}; cast k and v to the cache dtype first.")
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("write_kv_slots: k_pages and v_pages must be contiguous in the head dim (written in place).")
    T = k.shape[0]
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (T,) or slot_mapping.device != k.device:
        raise ValueError(f"write_kv_slots: slot_mapping must be an int64 tensor of shape [{T}] on {k.device}; "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)} on {slot_mapping.device}.")
    if T == 0:
        return
    if check_values:
        _check_slots(slot_mapping, k_pages.shape[0] * k_pages.shape[1])
    if use_cpu_kernels(k_pages):  # one index_copy_ per cache (kernels/cpu_attention.py)
        return cpu_attention.write_kv_slots(k_pages, v_pages, k, v, slot_mapping, k_scale, v_scale)
    if not use_triton(k_pages):
        return write_kv_slots_reference(*given, k, v, slot_mapping)
    write_kv_slots_launch(*given, _last_dim_contiguous(k), _last_dim_contiguous(v), slot_mapping)()


def shares_scale(k_pages: QuantizedPages, v_pages: QuantizedPages) -> bool:
    """Whether k and v pages share one scale tensor (MLA's latent cache: v = k[..., :Dv])."""
    k_scale, v_scale = k_pages.scale, v_pages.scale
    return k_scale is v_scale or (k_scale.device.type != "meta" and k_scale.data_ptr() == v_scale.data_ptr())


def write_kv_slots_launch(k_pages: torch.Tensor | QuantizedPages, v_pages: torch.Tensor | QuantizedPages,
                          k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> Launch:
    """The launch of _write_slots_kernel for checked inputs of write_kv_slots (k, v head dim contiguous):
    one program per (token, kv head). Over meta tensors it is what the AOT tests compile."""
    shared = isinstance(k_pages, QuantizedPages) and shares_scale(k_pages, v_pages)
    k_pages, v_pages, kv_args = _kv_launch_args(k_pages, v_pages)
    if shared:
        kv_args["SHARED_SCALE"] = True
    args = dict(k_pages_ptr=k_pages, v_pages_ptr=v_pages, k_ptr=k, v_ptr=v, slot_ptr=slot_mapping,
                stride_kp=k_pages.stride(0), stride_ks=k_pages.stride(1), stride_kh=k_pages.stride(2),
                stride_vp=v_pages.stride(0), stride_vs=v_pages.stride(1), stride_vh=v_pages.stride(2),
                stride_kt=k.stride(0), stride_kth=k.stride(1), stride_vt=v.stride(0), stride_vth=v.stride(1),
                D_QK=k.shape[-1], D_V=v.shape[-1], BLOCK_D=triton.next_power_of_2(k.shape[-1]),
                BLOCK_DV=triton.next_power_of_2(v.shape[-1]), PAGE_SIZE=k_pages.shape[1], **kv_args)
    return Launch(_write_slots_kernel, (k.shape[0], k.shape[1]), args, 4, 3)  # Triton's default warps, stages


def paged_prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor,
                            scale: float, window: int = 0, config: PrefillConfig | None = None, *,
                            check_values: bool = True, sinks: torch.Tensor | None = None,
                            alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over a paged cache that already holds them.

    q [T, H, Dqk]: sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 (varlen,
    packed), at positions context_lens[b] - q_len_b + i. k_pages [P, page_size, Hkv, Dqk], v_pages
    [P, page_size, Hkv, Dv] (strided views allowed, e.g. MLA's v = k_pages[..., :512]) hold each
    sequence's cached prefix and its new tokens (write_kv_slots first) at positions
    0 .. context_lens[b] - 1, position n in page block_table[b, n // page_size].
    cu_seqlens_q [B+1] int32, context_lens [B] int32, block_table [B, max_pages] int32.
    A query at position p sees keys j <= p and, if window > 0, p - j < window.
    Returns [T, H, Dv] in q's dtype. config: a PrefillConfig (key tiles may span pages); None:
    `paged_prefill_config` for this GPU. check_values=False skips the check that cu_seqlens_q and
    context_lens agree with T and the block table (~8 small kernels and an assert on CUDA, a host read on
    CPU): for callers that checked them already (models: the engine's runner checks each step once).
    sinks [H] float32: attention sinks (see the module docstring).
    k_pages / v_pages may be QuantizedPages (8-bit, dequantized in registers).
    alibi_slopes [H] fp32: ALiBi (module docstring); None: none.
    """
    given = k_pages, v_pages
    k_pages, v_pages, k_scale, v_scale = _unpack_pages(k_pages, v_pages, "paged_prefill_attention")
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.dim() != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"paged_prefill_attention: expected q [T,H,Dqk], k_pages [P,page_size,Hkv,Dqk], "
                         f"v_pages [P,page_size,Hkv,Dv]; got q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, "
                         f"v_pages {tuple(v_pages.shape)}.")
    _check_heads(q, k_pages, v_pages, "paged prefill", k_scale is not None)
    _check_window(window)
    _check_sinks(sinks, q.shape[1], q.device)
    _check_alibi(alibi_slopes, q.shape[1], q.device)
    B = context_lens.shape[0] if context_lens.dim() == 1 else -1
    _check_lens("context_lens", context_lens, B, q.device)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (B + 1,) or cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q must be an int32 tensor of shape [{B + 1}] on {q.device} (cumulative "
                         f"query counts, starting at 0); got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)} "
                         f"on {cu_seqlens_q.device}.")
    page_size = _check_block_table(block_table, k_pages, B, q.device)
    if config is not None:
        check_prefill_config(config)
    if check_values:
        _check_prefill_lens(cu_seqlens_q, context_lens, q.shape[0], block_table.shape[1] * page_size)
    if use_cpu_kernels(q):  # kernels/cpu_attention.py
        return cpu_attention.paged_prefill_attention(q, k_pages, v_pages, cu_seqlens_q, context_lens, block_table,
                                                     scale, window, k_scale, v_scale, sinks, alibi_slopes=alibi_slopes)
    if not use_triton(q):
        return paged_prefill_attention_reference(q, *given, cu_seqlens_q, context_lens, block_table, scale, window,
                                                 sinks, alibi_slopes=alibi_slopes)

    T, D_V = q.shape[0], v_pages.shape[-1]
    if config is None:
        config = paged_prefill_config(*head_blocks(q.shape[-1], D_V), compute_capability(q.device))
    if T == 0 or B == 0:
        return torch.empty(T, q.shape[1], D_V, dtype=q.dtype, device=q.device)
    launch, out = paged_prefill_launch(_last_dim_contiguous(q), *given, cu_seqlens_q, context_lens,
                                       block_table, scale, window, config, sinks, alibi_slopes=alibi_slopes)
    launch()
    return out


def paged_prefill_launch(q: torch.Tensor, k_pages: torch.Tensor | QuantizedPages,
                         v_pages: torch.Tensor | QuantizedPages, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, scale: float, window: int,
                         cfg: PrefillConfig, sinks: torch.Tensor | None = None, *,
                         alibi_slopes: torch.Tensor | None = None) -> tuple[Launch, torch.Tensor]:
    """The launch of _paged_prefill_kernel for checked inputs of paged_prefill_attention (q head dim
    contiguous, T and B > 0) and its output [T, H, Dv]. Over meta tensors it is what the AOT tests compile.

    Query blocks of all sequences are numbered in order: sum_b ceil(q_len_b / BLOCK_M) <= T / BLOCK_M + B,
    so a grid of that upper bound needs no host read of the lengths; a `work` table [2, programs] int32
    gives each program its (sequence, first query row), sequence -1 for the spare ones.
    """
    k_pages, v_pages, kv_args = _kv_launch_args(k_pages, v_pages)
    T, H, D_QK = q.shape
    B, D_V = context_lens.shape[0], v_pages.shape[-1]
    block_d, block_dr, block_dv = head_blocks(D_QK, D_V)
    num_work = triton.cdiv(T, cfg.BLOCK_M) + B
    blocks = (cu_seqlens_q[1:] - cu_seqlens_q[:-1] + cfg.BLOCK_M - 1) // cfg.BLOCK_M
    ends = torch.cumsum(blocks, 0)
    program = torch.arange(num_work, device=q.device, dtype=ends.dtype)
    seq = torch.searchsorted(ends, program, right=True)
    first = (program - (ends - blocks)[seq.clamp(max=B - 1)]) * cfg.BLOCK_M
    work = torch.stack([torch.where(seq < B, seq, -1), first]).to(torch.int32)
    out = torch.empty(T, H, D_V, dtype=q.dtype, device=q.device)
    args = dict(q_ptr=q, k_ptr=k_pages, v_ptr=v_pages, o_ptr=out, cu_seqlens_ptr=cu_seqlens_q,
                context_lens_ptr=context_lens, block_table_ptr=block_table, work_ptr=work,
                stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kp=k_pages.stride(0),
                stride_ks=k_pages.stride(1), stride_kh=k_pages.stride(2), stride_vp=v_pages.stride(0),
                stride_vs=v_pages.stride(1), stride_vh=v_pages.stride(2), stride_ot=out.stride(0),
                stride_oh=out.stride(1), stride_bt=block_table.stride(0), NUM_WORK=num_work, H=H, D_QK=D_QK,
                D_V=D_V, qk_scale=scale * LOG2E, window=window, GROUP=H // k_pages.shape[2],
                HAS_WINDOW=window > 0, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=block_d,
                BLOCK_DR=block_dr, BLOCK_DV=block_dv, PAGE_SIZE=k_pages.shape[1],
                sinks_ptr=q if sinks is None else sinks, HAS_SINKS=sinks is not None, **kv_args,
                alibi_ptr=q if alibi_slopes is None else alibi_slopes * LOG2E, HAS_ALIBI=alibi_slopes is not None)
    return Launch(_paged_prefill_kernel, (num_work, H), args, cfg.num_warps, cfg.num_stages), out


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Pages [P, page_size, Hkv, D] -> per-sequence [B, max_pages * page_size, Hkv, D] (a copy)."""
    pages = cache[block_table.long().clamp(0, cache.shape[0] - 1)]  # entries past a sequence are never read
    return pages.flatten(1, 2)


def decode_attention_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               cache_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                               window: int = 0, sinks: torch.Tensor | None = None, *,
                               alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, float32: each sequence's pages gathered into rows, softmax over its positions
    < cache_lens[b] (and, if window > 0, >= cache_lens[b] - window); sinks [H]: one more logit per head
    in the softmax, whose probability is dropped (transformers' gpt-oss eager attention).

    Query heads are grouped by kv head ([B, Hkv, group, Dqk] @ [B, Hkv, Dqk, Smax]), so GQA copies
    no cache rows. QuantizedPages are dequantized to float32 first.
    """
    k_cache, v_cache = (gather_pages(dequantize_pages(pages), block_table) for pages in (k_pages, v_pages))
    B, H, _ = q.shape
    S_max, H_kv = k_cache.shape[1], k_cache.shape[2]
    scores = q.float().reshape(B, H_kv, H // H_kv, -1) @ k_cache.float().permute(0, 2, 3, 1) * scale
    # scores [B, Hkv, group, Smax]: hide positions past each length (always: whether any sequence is
    # shorter than Smax is a device value, and reading it on the host would sync every layer)
    pos = torch.arange(S_max, device=q.device)
    pad = pos >= cache_lens[:, None]
    if window:
        pad = pad | (pos < cache_lens[:, None] - window)
    if alibi_slopes is not None:  # slope[h] * (key - query position), the query at cache_lens - 1
        offset = (pos[None, :] - (cache_lens[:, None] - 1)).float()  # [B, Smax]
        scores = scores + alibi_slopes.float().view(1, H_kv, H // H_kv, 1) * offset[:, None, None, :]
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = _softmax_with_sinks(scores, None if sinks is None else sinks.view(H_kv, H // H_kv, 1))
    out = probs @ v_cache.float().transpose(1, 2)  # [B, Hkv, group, Dv]
    # A sequence with no keys (a padding row, context length 0) gets zeros, as the kernel gives, not NaN.
    out = torch.where(cache_lens[:, None, None, None] > 0, out, 0.0)
    return out.reshape(B, H, -1).to(q.dtype)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim; with sinks (broadcast to scores[..., :1]) a sink column joins the
    softmax and is then dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink_column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]


def quantize_kv_reference(k_pages: QuantizedPages, v_pages: QuantizedPages, k: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Plain torch: k [T, Hkv, Dqk], v [T, Hkv, Dv] -> (k codes, v codes) in the pages' dtype and, for int8,
    their scales [T, Hkv] (None for fp8's per-tensor scales), as the module docstring defines them."""
    if k_pages.data.dtype == torch.float8_e4m3fn:
        return (*((x.float() / pages.scale).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(torch.float8_e4m3fn)
                  for x, pages in ((k, k_pages), (v, v_pages))), None, None)
    k_absmax, v_absmax = k.float().abs().amax(-1), v.float().abs().amax(-1)
    if shares_scale(k_pages, v_pages):
        k_absmax = v_absmax = torch.maximum(k_absmax, v_absmax)
    scales = [absmax.clamp(min=KV_SCALE_EPS) / KV_INT8_MAX for absmax in (k_absmax, v_absmax)]
    codes = [torch.floor(x.float() / s[..., None] + 0.5).clamp(-KV_INT8_MAX, KV_INT8_MAX).to(torch.int8)
             for x, s in zip((k, v), scales)]
    return codes[0], codes[1], scales[0], scales[1]


def write_kv_slots_reference(k_pages: torch.Tensor | QuantizedPages, v_pages: torch.Tensor | QuantizedPages,
                             k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """index_put: token t to page slot_mapping[t] // block_size, row slot_mapping[t] % block_size;
    negative slots (padding) are skipped.

    Shape-static, with no host read (TRITONQ_BACKEND=torch runs it on any device): rather than selecting
    the kept rows (a data-dependent shape), every skipped row is redirected to the slot of the first kept
    row with that row's own values, so the duplicate writes agree; with no kept row at all they all
    write slot 0's current values back. QuantizedPages get `quantize_kv_reference`'s codes (fp8 as its
    bytes) and, for int8, its scales at the same [page, row]."""
    keep = slot_mapping >= 0
    first = keep.to(torch.int8).argmax(0, keepdim=True)  # [1]: the first kept row (0 when there is none)
    target = torch.where(keep, slot_mapping, slot_mapping[first].clamp(min=0)).long()
    page, row = target // k_pages.shape[1], target % k_pages.shape[1]
    writes = [(k_pages, k), (v_pages, v)]
    if isinstance(k_pages, QuantizedPages):
        k_codes, v_codes, k_scales, v_scales = quantize_kv_reference(k_pages, v_pages, k, v)
        writes = [(k_pages.data.view(torch.uint8), k_codes.view(torch.uint8)),
                  (v_pages.data.view(torch.uint8), v_codes.view(torch.uint8))]
        if k_scales is not None:
            writes += [(k_pages.scale, k_scales), (v_pages.scale, v_scales)]
    for pages, new in writes:
        fill = torch.where(keep[first], new[first], pages[0, 0])  # what skipped rows write (to `target`)
        pages[page, row] = torch.where(keep.view(-1, *[1] * (new.dim() - 1)), new, fill)


def paged_prefill_attention_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                      block_table: torch.Tensor, scale: float, window: int = 0,
                                      sinks: torch.Tensor | None = None, *,
                                      alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, float32, one sequence at a time: gather its context_lens[b] keys from its pages,
    masked softmax with query i at position context_lens[b] - q_len + i (causal, optional window),
    sinks [H] as decode_attention_reference's. QuantizedPages are dequantized to float32 first."""
    k_pages, v_pages = dequantize_pages(k_pages), dequantize_pages(v_pages)
    H, group = q.shape[1], q.shape[1] // k_pages.shape[2]
    block_size = k_pages.shape[1]
    out = torch.zeros(q.shape[0], H, v_pages.shape[-1], dtype=torch.float32, device=q.device)
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    for b in range(len(ctx)):
        n_q, n_k = cu[b + 1] - cu[b], ctx[b]
        if n_q == 0:
            continue
        pages = block_table[b, :-(-n_k // block_size)].long()
        k = k_pages[pages].flatten(0, 1)[:n_k].float().repeat_interleave(group, dim=1)  # [n_k, H, Dqk]
        v = v_pages[pages].flatten(0, 1)[:n_k].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b + 1]].float(), k) * scale
        p = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        visible = (j <= p) & ((p - j < window) if window else True)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float()[:, None, None] * (j - p).float()
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = _softmax_with_sinks(scores, None if sinks is None else sinks.view(H, 1, 1))
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Tuning (python -m tritonq.tune --kernel attention_prefill / attention_decode)
# ----------------------------------------------------------------------------------------------

# Values the tuner sweeps (the tuned fields of PrefillConfig / DecodeConfig), over 16-token pages (the
# engine's default block_size); a decode key tile lies in one page, so decode's BLOCK_N is <= the page.
PREFILL_SPACE = {"BLOCK_M": [64, 128], "BLOCK_N": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}
PREFILL_FORMAT = "BxSxHxHkvxDqkxDv"  # sequences, tokens of each (the first; others random), heads, head dims
DECODE_SPACE = {"BLOCK_N": [16, 32], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]}
DECODE_FORMAT = "BxSmaxxHxHkvxDqkxDv"  # batch, cache capacity, heads, head dims
TUNE_PAGE_SIZE = 16
# Attention outputs are convex combinations of N(0, 1) value rows (|o| < ~4). In bf16 the kernel
# rounds p to bf16 before the PV dot and rounds the output (2^-9 relative each), so 2e-2 bounds
# it; fp32 (interpreter) differs only by summation order and exp2 vs exp.
TUNE_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int, num_pages: int | None = None,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence k [B, S, Hkv, Dqk], v [B, S, Hkv, Dv] -> (k_pages, v_pages [num_pages, page_size, Hkv, D],
    block_table [B, ceil(S / page_size)] int32): each sequence's positions in pages taken in random order
    from a pool of num_pages (default: just enough); unused pages and rows hold random values, which the
    kernels must never read. For tests, the tuner and benchmarks."""
    B, S = k.shape[:2]
    per_seq = -(-S // page_size)
    num_pages = num_pages or B * per_seq
    if num_pages < B * per_seq:
        raise ValueError(f"paged_cache: {B} sequences of {S} tokens need {B * per_seq} pages of {page_size}, "
                         f"got num_pages = {num_pages}")
    made_on = generator.device if generator is not None else k.device  # a generator draws on its own device
    table = torch.randperm(num_pages, generator=generator, device=made_on)[:B * per_seq].view(B, per_seq)
    table = table.to(torch.int32)
    pages = []
    for x in (k, v):
        pool = torch.randn(num_pages, page_size, *x.shape[2:], generator=generator, device=made_on)
        pool = pool.to(x.device, x.dtype)
        padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, per_seq * page_size - S))
        pool[table.flatten().long().to(x.device)] = padded.reshape(B * per_seq, page_size, *x.shape[2:])
        pages.append(pool)
    return pages[0], pages[1], table.to(k.device)


def paged_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], page_size: int,
                  num_pages: int | None = None, generator: torch.Generator | None = None) -> tuple:
    """Whole prompts as the engine prefills them: right-padded q [B, S, H, Dqk], k [B, S, Hkv, Dqk],
    v [B, S, Hkv, Dv] with seq_lens [B] -> paged_prefill_attention's arguments before scale: (q packed
    [sum(seq_lens), H, Dqk], k_pages, v_pages, cu_seqlens_q, context_lens, block_table), pages as
    `paged_cache` lays them out. For tests, the tuner and benchmarks."""
    k_pages, v_pages, table = paged_cache(k, v, page_size, num_pages, generator)
    packed = torch.cat([q[b, :n] for b, n in enumerate(seq_lens)])
    cu_seqlens = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=q.device)
    return packed, k_pages, v_pages, cu_seqlens, torch.tensor(seq_lens, dtype=torch.int32, device=q.device), table


def _tune_shape(shape, target: str, shape_format: str) -> tuple[int, ...]:
    from tritonq.kernels.common import unpack_shape

    shape = unpack_shape(shape, target, shape_format)
    if shape[2] % shape[3]:
        raise ValueError(f"{target} shape {'x'.join(map(str, shape))}: query heads H={shape[2]} must be a "
                         f"multiple of kv heads Hkv={shape[3]}")
    return shape


def _candidates(space: dict, keep) -> list[dict]:
    """Every config of the product `space` ({field: values}) that keep(config) accepts, in order."""
    return [c for c in (dict(zip(space, values)) for values in itertools.product(*space.values())) if keep(c)]


def prefill_sweep_space(shape) -> list[dict]:
    """Tiles wider than the sequence (rounded up to a power of two) only compute padding."""
    _, S, *_ = _tune_shape(shape, "attention_prefill", PREFILL_FORMAT)
    return _candidates(PREFILL_SPACE, lambda c: c["BLOCK_M"] <= max(64, triton.next_power_of_2(S))
                       and c["BLOCK_N"] <= max(32, triton.next_power_of_2(S)))


def decode_sweep_space(shape) -> list[dict]:
    """Key tiles within a page, and not wider than the cache (rounded up to a power of two)."""
    _, S_max, *_ = _tune_shape(shape, "attention_decode", DECODE_FORMAT)
    widest = min(TUNE_PAGE_SIZE, max(16, triton.next_power_of_2(S_max)))
    return _candidates(DECODE_SPACE, lambda c: c["BLOCK_N"] <= widest)


def _meta_pages(B: int, S: int, H_kv: int, d_qk: int, d_v: int):
    """bf16 meta pages of TUNE_PAGE_SIZE for B sequences of S tokens, and their block table."""
    per_seq = -(-S // TUNE_PAGE_SIZE)
    meta = dict(dtype=torch.bfloat16, device="meta")
    return (torch.empty(B * per_seq, TUNE_PAGE_SIZE, H_kv, d_qk, **meta),
            torch.empty(B * per_seq, TUNE_PAGE_SIZE, H_kv, d_v, **meta),
            torch.empty(B, per_seq, dtype=torch.int32, device="meta"))


def prefill_aot_launch(config: PrefillConfig, shape) -> Launch:
    """`paged_prefill_launch` over meta tensors: B sequences of S new bf16 tokens over 16-token pages."""
    B, S, H, H_kv, d_qk, d_v = _tune_shape(shape, "attention_prefill", PREFILL_FORMAT)
    k_pages, v_pages, table = _meta_pages(B, S, H_kv, d_qk, d_v)
    i32 = dict(dtype=torch.int32, device="meta")
    q = torch.empty(B * S, H, d_qk, dtype=torch.bfloat16, device="meta")
    return paged_prefill_launch(q, k_pages, v_pages, torch.empty(B + 1, **i32), torch.empty(B, **i32), table,
                                d_qk ** -0.5, 0, config)[0]


def decode_aot_launch(config: dict, shape, cc: int) -> Launch:
    """The split kernel of `decode_launches` over meta tensors: bf16 q and 16-token bf16 pages,
    NUM_SPLITS as `decode_config` picks it on sm_`cc`'s usual SM count (`aot.SM_COUNT`)."""
    from tritonq.kernels.aot import SM_COUNT

    B, S_max, H, H_kv, d_qk, d_v = _tune_shape(shape, "attention_decode", DECODE_FORMAT)
    cfg = fit_decode_config(DecodeConfig(NUM_SPLITS=1, **config), B, H_kv, S_max, TUNE_PAGE_SIZE,
                            SM_COUNT.get(cc, 108))
    k_pages, v_pages, table = _meta_pages(B, S_max, H_kv, d_qk, d_v)
    q = torch.empty(B, H, d_qk, dtype=torch.bfloat16, device="meta")
    lens = torch.empty(B, dtype=torch.int32, device="meta")
    return decode_launches(q, k_pages, v_pages, lens, table, d_qk ** -0.5, 0, cfg)[0]
