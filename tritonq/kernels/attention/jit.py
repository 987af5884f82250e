"""The @triton.jit kernels: the shared online-softmax tile step (`_attend_tile`), paged prefill, split-KV
decode and its merge, and the write of new keys into the pages. Launched only from `launch.py`."""
from __future__ import annotations

import triton
import triton.language as tl

from tritonq.kernels.attention.pages import _KV_FP8_MAX, _KV_INT8_MAX, _KV_SCALE_EPS
from tritonq.kernels.common import E4M3_TO_FP16_BIAS, e4m3_bits_from_fp32, e4m3_bits_to_fp16, ieee_dot

@triton.jit
def _attend_tile(q, q_tail, k_rows, v_rows, key_ok, visible, m_i, l_i, acc, offs_d, offs_dr, offs_dv,
                 D_QK, D_V, qk_scale, BLOCK_DR: tl.constexpr, k_scale_ptr=None, v_scale_ptr=None, scale_rows=None,
                 KV_FP8: tl.constexpr = False, KV_INT8: tl.constexpr = False, bias=None,
                 V_PAIRS: tl.constexpr = False):
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
    [BLOCK_N] are read at k_scale_ptr / v_scale_ptr + scale_rows. V_PAIRS: 8-bit values are read as byte pairs
    (an even Dv, checked by the launcher); decode always, prefill before sm_90 (PrefillConfig.v_pairs: its 128-row
    tiles spill with them on sm_90, docs/decode_step.md).
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
    if V_PAIRS and (KV_INT8 or KV_FP8):
        # 8-bit values as byte pairs: int16 words [BLOCK_N, BLOCK_DV / 2] come in 16-byte cp.async loads (a byte
        # tile feeding the dot directly came in 8-byte ones: the keys, its K dim, are strided in memory); the low
        # and high bytes (even and odd value columns) meet p in two dots, interleaved back into acc's columns
        offs_w = tl.arange(0, offs_dv.shape[0] // 2)
        words = tl.load(v_rows.to(tl.pointer_type(tl.int16), bitcast=True)[:, None] + offs_w[None, :],
                        mask=key_ok[:, None] & (offs_w[None, :] < D_V // 2), other=0)
        l_i = l_i * alpha + tl.sum(p, 1)  # first, so that the scaled p replaces p (128-row tiles spilled otherwise)
        if KV_INT8:  # each value row's scale multiplies its probability column: [M, BLOCK_N] products
            p = p * tl.load(v_scale_ptr + scale_rows, mask=key_ok, other=0.0)[None, :]
        p = p.to(q.dtype)
        even = ieee_dot(p, _kv_tile(((words << 8) >> 8).to(tl.int8), q.dtype, KV_FP8), None)
        odd = ieee_dot(p, _kv_tile((words >> 8).to(tl.int8), q.dtype, KV_FP8), None)
        acc = acc * alpha[:, None] + tl.reshape(tl.join(even, odd), acc.shape)
    else:
        v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=key_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        if KV_INT8:  # as above, over the byte tile
            l_i = l_i * alpha + tl.sum(p, 1)
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
                          HAS_ALIBI: tl.constexpr = False, V_PAIRS: tl.constexpr = False):
    """One program: BLOCK_M consecutive new tokens of one sequence, one query head, over paged keys.

    work [2, NUM_WORK] int32 (built by the launcher on the device, no host sync): the sequence of
    each query block (-1: none, the grid is an upper bound) and its first query row in that sequence.
    Query row i of sequence b is at position ctx - q_len + i; keys 0..ctx-1 live in the pages of
    block_table[b]. Each key of a tile looks up its own page (BLOCK_N int loads, from cache), so
    key tiles may be longer than a page: 16-token pages still get 64-key tiles.
    HAS_SINKS: sinks_ptr [H] fp32; each row's softmax starts from the sink (max = its logit, sum = 1,
    nothing accumulated), a key whose value row is zero.
    KV_FP8 / KV_INT8: quantized pages with their scales (module docstring); V_PAIRS: their V tiles as byte pairs.
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
                                     (page * PAGE_SIZE + page_rows) * (H // GROUP) + kv_h, KV_FP8, KV_INT8, bias,
                                     V_PAIRS)

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
                         KV_INT8: tl.constexpr = False, alibi_ptr=None, HAS_ALIBI: tl.constexpr = False,
                         o_ptr=None, stride_ob=0, stride_oh=0, sinks_ptr=None, HAS_SINKS: tl.constexpr = False):
    """Stage 1. One program: one KV split of one (sequence, kv head, block of its query heads).

    All query heads sharing a kv head are one tl.dot operand, so each K/V tile is read once per
    kv head (GQA costs no extra bandwidth). Writes the split's normalized output to
    part_o [B, H, NUM_SPLITS, D_V] fp32 and its log2-sum-exp to part_lse [B, H, NUM_SPLITS];
    with NUM_SPLITS == 1 the merge is folded in: the output o [B, H, D_V] is written directly in o's
    dtype (HAS_SINKS: the head's sink sinks_ptr [H] fp32 joins the denominator, as in the merge).
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
                                     (page * PAGE_SIZE + rows) * (H // GROUP) + kv_h, KV_FP8, KV_INT8, bias,
                                     V_PAIRS=True)

    if NUM_SPLITS == 1:  # the merge folded in: this program saw all the keys
        # no keys (a padding row): l_i = 0, acc = 0, output 0; a sink (log2 domain) adds e^(sink) to the sum
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0) * 1.4426950408889634
            top = tl.maximum(m_i, sink)  # finite: rescale both terms by it, so nothing overflows
            alpha = tl.exp2(m_i - top)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - top)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if KV_FP8:
            out = out * (tl.load(v_scale_ptr) * E4M3_TO_FP16_BIAS)
        tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=head_mask[:, None] & (offs_dv[None, :] < D_V))
    else:  # an empty split stores lse = -inf and a zero output; the merge gives it weight 0
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
                        KV_INT8: tl.constexpr = False, SHARED_SCALE: tl.constexpr = False,
                        q_ptr=None, q_out_ptr=None, cos_ptr=None, sin_ptr=None, q_norm_ptr=None, k_norm_ptr=None,
                        stride_qt=0, stride_qth=0, stride_ot=0, stride_oth=0, stride_cos=0, eps=0.0,
                        H_Q: tl.constexpr = 0, ROPE: tl.constexpr = False, QK_NORM: tl.constexpr = False):
    """Program (token t, head h): h < H_Q rotates query head h into q_out; the others copy the k and v rows of
    kv head h - H_Q to the token's slot (a slot < 0 writes nothing).

    ROPE: k (and the H_Q query heads) are first rotated by the token's cos / sin rows (rotate-half, fp32,
    rounded once to the input dtype); QK_NORM: each head row is RMS-normalized by q_norm / k_norm [D] before
    that (Qwen3). So one launch does a layer's rope and its KV write (H_Q = 0, no ROPE: the plain write).
    KV_FP8: the rows are divided by the per-tensor scales and stored as e4m3 bytes (saturating at +-448).
    KV_INT8: each row gets scale = absmax / 127 (SHARED_SCALE: one for k and v, the larger absmax),
    stored at scales[slot, head], and codes floor(x / scale + 0.5)."""
    t = tl.program_id(0).to(tl.int64)  # t x stride_kt: past 2^31 elements for MLA prefill's long contexts
    h = tl.program_id(1) - H_Q  # the kv head (< 0: a query head's program)
    offs_d = tl.arange(0, BLOCK_D)
    if H_Q > 0:
        if h < 0:
            q = _rope_row(q_ptr + t * stride_qt + (h + H_Q) * stride_qth, offs_d, D_QK, cos_ptr, sin_ptr,
                          t * stride_cos, q_norm_ptr, eps, ROPE, QK_NORM)
            tl.store(q_out_ptr + t * stride_ot + (h + H_Q) * stride_oth + offs_d, q, mask=offs_d < D_QK)
    if h >= 0:
        _write_slot(k_pages_ptr, v_pages_ptr, k_ptr, v_ptr, slot_ptr, t, h, tl.num_programs(1) - H_Q,
                    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                    stride_kt, stride_kth, stride_vt, stride_vth, D_QK, D_V, BLOCK_D, BLOCK_DV, PAGE_SIZE,
                    k_scale_ptr, v_scale_ptr, KV_FP8, KV_INT8, SHARED_SCALE, cos_ptr, sin_ptr, t * stride_cos,
                    k_norm_ptr, eps, ROPE, QK_NORM)


@triton.jit
def _rope_row(row_ptr, offs, D, cos_ptr, sin_ptr, cos_offset, norm_ptr, eps, ROPE: tl.constexpr,
              QK_NORM: tl.constexpr):
    """One head row [BLOCK] (lanes >= D are 0), optionally RMS-normalized by norm_ptr [D] and rotated by the
    cos / sin rows at cos_offset (x cos + rotate_half(x) sin, rotate_half(x)[i] = -x[i + D/2] below D/2,
    x[i - D/2] above),
    in fp32, returned in the row's dtype."""
    mask = offs < D
    x = tl.load(row_ptr + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if ROPE:
        half = D // 2
        partner = tl.where(offs < half, offs + half, offs - half)
        x2 = tl.load(row_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        x = x * rstd * tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ROPE:
            x2 = x2 * rstd * tl.load(norm_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    if ROPE:
        cos = tl.load(cos_ptr + cos_offset + offs, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cos_offset + offs, mask=mask, other=0.0).to(tl.float32)
        x = x * cos + tl.where(offs < half, -x2, x2) * sin
    return x.to(dtype)


@triton.jit
def _write_slot(k_pages_ptr, v_pages_ptr, k_ptr, v_ptr, slot_ptr, t, h, H_KV,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_kt, stride_kth, stride_vt, stride_vth, D_QK, D_V,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE_SIZE: tl.constexpr,
                k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr, KV_INT8: tl.constexpr, SHARED_SCALE: tl.constexpr,
                cos_ptr, sin_ptr, cos_offset, k_norm_ptr, eps, ROPE: tl.constexpr, QK_NORM: tl.constexpr):
    """_write_slots_kernel's kv program: token t's k (normalized and rotated if asked) and v rows of kv head h
    (of H_KV) to its slot."""
    slot = tl.load(slot_ptr + t)
    page, row = slot // PAGE_SIZE, slot % PAGE_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if ROPE or QK_NORM:
        k = _rope_row(k_ptr + t * stride_kt + h * stride_kth, offs_d, D_QK, cos_ptr, sin_ptr, cos_offset, k_norm_ptr,
                      eps, ROPE, QK_NORM)
    else:
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
        scale_row = slot * H_KV + h  # scales [P, PAGE_SIZE, Hkv] contiguous: slot x Hkv + head
        tl.store(k_scale_ptr + scale_row, k_scale, mask=slot >= 0)
        tl.store(v_scale_ptr + scale_row, v_scale, mask=slot >= 0)
    # slot is broadcast to a vector first because the interpreter rejects scalar & vector masks.
    tl.store(k_pages_ptr + page * stride_kp + row * stride_ks + h * stride_kh + offs_d, k,
             mask=(offs_d < D_QK) & (slot + 0 * offs_d >= 0))
    tl.store(v_pages_ptr + page * stride_vp + row * stride_vs + h * stride_vh + offs_dv, v,
             mask=(offs_dv < D_V) & (slot + 0 * offs_dv >= 0))
