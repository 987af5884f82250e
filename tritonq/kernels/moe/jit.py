"""The @triton.jit expert GEMM: `_moe_gemm_kernel` and the tile loads it is built from. Launched only from
`launch.py`.

One program covers BLOCK_M rows of the order `routing.moe_align_block_size` sorted by expert (each M block
belongs to one expert) x BLOCK_N output columns; a launch covers all experts, once for gate/up (two
accumulators, SiLU-and-mul or ClampedSwiGLU fused in the epilogue) and once for down (routing weight
multiplied in).
MXFP4 experts: from sm_80 (WORD_DEQUANT) 8 codes a 32-bit word become bf16 / fp16 weights times their scale by
inline PTX (`common.mxfp4_words_to_half`); on sm_75 the codes are decoded with integer ops (`e2m1_bits_to_fp16`)
and scaled in fp32 per 32 along K. The dot runs in the activations' dtype, as for int4.
The K loop runs the whole K tiles unmasked (`_k_step`) and the ragged last one after it, masked.
FP8 experts, W8A8 (A_FP8): e4m3 x e4m3 dots in fp32, scales applied after each K tile (block) or once (per
token x per channel); weight-only otherwise (codes dequantized to the activations' dtype in the tile load).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tritonq.kernels.common import (
    E4M3_TO_FP16_BIAS,
    dequantize_int_tile,
    e2m1_bits_to_fp16,
    e4m3_bits_to_fp16,
    int4_words_minus_zero,
    mxfp4_words_to_half,
    sum_expert_slots,
    unpack_int_tile,
)

DENSE, INT4, FP8, MXFP4 = 0, 1, 2, 3  # the kernel's KIND: how the weight tile is loaded


@triton.jit
def _load_weight_tile(w_base, scale_base, zero_base, g_idx_base, k0, offs_n, K, N,
                      stride_wn, stride_wk, stride_sn, stride_sk,
                      group_size: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      HAS_G_IDX: tl.constexpr, TILE_SCALE_ROW: tl.constexpr, SCALE_BN: tl.constexpr,
                      SCALE_BK: tl.constexpr, FP8_AS_BITS: tl.constexpr, COMPUTE: tl.constexpr, BLOCK_K: tl.constexpr,
                      MASK_K: tl.constexpr, MASK_N: tl.constexpr, FP8_CODES: tl.constexpr,
                      WORD_DEQUANT: tl.constexpr, SCALE_AFTER_DOT: tl.constexpr, MXFP4_STEPS: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile W[n, k]^T (rows k0 .. k0 + BLOCK_K) of the expert whose weights, scales, zeros
    and g_idx start at the *_base pointers, dequantized to COMPUTE (zero outside K, N). MASK_K / MASK_N: whether
    the tile can reach past K / N (else no masks). group_size is a constexpr: its divisions are shifts.
    WORD_DEQUANT: 4-bit int codes by `common.int4_words_minus_zero` (`common.int4_word_dequant` says when), MXFP4
    codes by `common.mxfp4_words_to_half` (`common.mxfp4_word_decode`; MXFP4_STEPS scale factors).
    SCALE_AFTER_DOT (int4 words, one scale row per tile): q - zero only, exact; the kernel scales the dot.
    FP8_CODES (W8A8 fp8 experts): the e4m3 codes themselves, unscaled (the kernel applies `_fp8_scale_row`)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_in = offs_k < K
    n_in = offs_n < N
    if not MASK_K:
        k_in = tl.full((BLOCK_K,), 1, tl.int1)
    if not MASK_N:
        n_in = tl.full(offs_n.shape, 1, tl.int1)
    mask = k_in[:, None] & n_in[None, :]
    if KIND == 0:  # dense [E, N, K]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=mask, other=0.0)
        w = w.to(COMPUTE)
    elif KIND == 1:  # int: qweight [E, K*BITS/32, N], packed along K (stride_wk is the packed-row stride)
        PACK: tl.constexpr = 32 // BITS
        offs_word = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
        word_in = offs_word < K // PACK
        if not MASK_K:
            word_in = tl.full((BLOCK_K // PACK,), 1, tl.int1)
        words = tl.load(w_base + offs_word[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                        mask=word_in[:, None] & n_in[None, :], other=0)
        q = words  # the word path reads the words themselves; else unpacked right after the load (unpack_int_tile)
        if not WORD_DEQUANT:
            q = unpack_int_tile(words, BITS)
        if TILE_SCALE_ROW:  # the whole K tile is in one group: one [1, BLOCK_N] row of scales/zeros
            s_off = (k0 // group_size) * stride_sk + offs_n[None, :] * stride_sn
            s_mask = n_in[None, :]
        else:
            if HAS_G_IDX:
                group = tl.load(g_idx_base + offs_k, mask=k_in, other=0)
            else:
                group = offs_k // group_size
            s_off = group[:, None] * stride_sk + offs_n[None, :] * stride_sn
            s_mask = mask
        scale = 0.0  # SCALE_AFTER_DOT: the kernel loads it (`_int4_scale_row`)
        if not SCALE_AFTER_DOT:
            scale = tl.load(scale_base + s_off, mask=s_mask, other=0.0)
        zero = scale  # read only with HAS_ZEROS (else symmetric: zero = 2^(bits-1))
        if HAS_ZEROS:
            zero = tl.load(zero_base + s_off, mask=s_mask, other=0.0)
        if WORD_DEQUANT:  # 4-bit codes from the packed words by bit tricks (common.int4_words_to_magic)
            w = int4_words_minus_zero(q, zero, HAS_ZEROS, COMPUTE)
            if not SCALE_AFTER_DOT:
                w = (w * scale).to(COMPUTE)
        else:
            w = dequantize_int_tile(q, scale, zero, BITS, HAS_ZEROS, COMPUTE)
    elif KIND == 3 and WORD_DEQUANT:  # mxfp4 as int32 words [E, N, K/8] (stride_wk = 1), 8 codes each
        # rows of K / 8 words (K % 32 == 0) and tiles at multiples of 32 codes: 16-byte aligned, for wide loads
        rows = w_base + tl.multiple_of(offs_n.to(tl.int64) * stride_wn, 4)
        offs_word = tl.multiple_of(k0 // 8, 4) + tl.arange(0, BLOCK_K // 8)
        word_in = offs_word // 4 < K // 32  # masked by group: constant over 16 bytes
        if not MASK_K:
            word_in = tl.full((BLOCK_K // 8,), 1, tl.int1)
        word_mask = word_in[:, None] & n_in[None, :]
        words = tl.load(rows[None, :] + offs_word[:, None], mask=word_mask, other=0)
        # one E8M0 exponent per group of 4 words (mxfp4_words_to_half broadcasts it)
        GROUPS: tl.constexpr = BLOCK_K // 32
        offs_group = k0 // 32 + tl.arange(0, GROUPS)
        group_in = offs_group < K // 32
        if not MASK_K:
            group_in = tl.full((GROUPS,), 1, tl.int1)
        scale_bits = tl.load(scale_base + offs_n[None, :] * stride_sn + offs_group[:, None] * stride_sk,
                             mask=group_in[:, None] & n_in[None, :], other=0).to(tl.int32)
        w = mxfp4_words_to_half(words, scale_bits, COMPUTE, MXFP4_STEPS)
    elif KIND == 3:  # mxfp4: blocks [E, N, K/2] bytes (stride_wk = 1), scales [E, N, K/32] uint8 E8M0
        offs_byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_base + offs_n[None, :] * stride_wn + offs_byte[:, None],
                         mask=(offs_byte[:, None] < K // 2) & n_in[None, :], other=0).to(tl.int32)
        # byte j holds elements 2j (low nibble) and 2j + 1 (high): [BLOCK_K/2, 2, BLOCK_N] -> K order
        codes = (packed[:, None, :] >> (tl.arange(0, 2) * 4)[None, :, None]) & 15
        codes = tl.reshape(codes, (BLOCK_K, offs_n.shape[0]))
        # One scale per 32 rows of the tile (BLOCK_K % 32 == 0, checked by the launcher), broadcast in registers:
        # a per-element gather would hold a [BLOCK_K, BLOCK_N] tile of 64-bit addresses (spills at 16 rows).
        GROUPS: tl.constexpr = BLOCK_K // 32
        offs_group = k0 // 32 + tl.arange(0, GROUPS)
        scale_bits = tl.load(scale_base + offs_n[None, :] * stride_sn + offs_group[:, None] * stride_sk,
                             mask=(offs_group[:, None] < K // 32) & n_in[None, :], other=0).to(tl.int32)
        # e2m1_bits_to_fp16 gives value / 2^14; fp32 bits (s + 14) << 23 are 2^(s - 127) x 2^14 for s <= 240
        # (the loader refuses larger scales)
        scale = ((scale_bits + 14) << 23).to(tl.float32, bitcast=True)
        w = tl.reshape(e2m1_bits_to_fp16(codes).to(tl.float32), (GROUPS, 32, offs_n.shape[0])) * scale[:, None, :]
        w = tl.reshape(w, (BLOCK_K, offs_n.shape[0])).to(COMPUTE)
    elif FP8_CODES:  # fp8 [E, N, K] as float8e4nv, for an e4m3 x e4m3 dot
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=mask, other=0.0)
    else:  # fp8 [E, N, K]; scale index (n // SCALE_BN, k // SCALE_BK), strides 0 where constant
        w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        if FP8_AS_BITS:  # no fp8 types below sm_89: decode the bytes (exact; x 2^8 in fp32 undoes the bias)
            w = e4m3_bits_to_fp16(tl.load(w_ptrs, mask=mask, other=0)).to(tl.float32) * E4M3_TO_FP16_BIAS
        else:
            w = tl.load(w_ptrs, mask=mask, other=0.0)
        if TILE_SCALE_ROW:  # scales do not vary along K inside the tile: one [1, BLOCK_N] row
            s_off = (offs_n[None, :] // SCALE_BN) * stride_sn + (k0 // SCALE_BK) * stride_sk
            scale = tl.load(scale_base + s_off, mask=n_in[None, :], other=0.0)
        else:
            s_off = (offs_n[None, :] // SCALE_BN) * stride_sn + (offs_k[:, None] // SCALE_BK) * stride_sk
            scale = tl.load(scale_base + s_off, mask=mask, other=0.0)
        w = (w.to(tl.float32) * scale).to(COMPUTE)
    return w


@triton.jit
def _int4_scale_row(scale_base, k0, offs_n, N, stride_sn, stride_sk, group_size: tl.constexpr,
                    MASK_N: tl.constexpr):
    """The fp32 scales of columns offs_n for the K tile at k0 (inside one group), as a [1, BLOCK_N] row: the int4
    word path's SCALE_AFTER_DOT multiplies the dot's result by it."""
    n_in = offs_n < N
    if not MASK_N:
        n_in = tl.full(offs_n.shape, 1, tl.int1)
    s = tl.load(scale_base + (k0 // group_size) * stride_sk + offs_n * stride_sn, mask=n_in, other=0.0)
    return s.to(tl.float32)[None, :]


@triton.jit
def _fp8_scale_row(scale_ptr, expert, k0, n0, N, stride_se, stride_sn, stride_sk, SCALE_BN: tl.constexpr,
                   SCALE_BK: tl.constexpr, BLOCK_N: tl.constexpr, ONE_W_SCALE: tl.constexpr):
    """The fp32 weight scales of columns n0 .. n0 + BLOCK_N at input row k0, as a [1, BLOCK_N] row, or, with
    ONE_W_SCALE (the tile lies inside one scale block: 128 x 128 blocks, BLOCK_N <= 128), one scalar: one load
    and no registers for a row of equal values (without it gate/up spills 16 B on sm_89). Per tensor /
    channel: SCALE_BN = SCALE_BK = 1, strides 0 where constant."""
    base = scale_ptr + expert.to(tl.int64) * stride_se + (k0 // SCALE_BK) * stride_sk
    if ONE_W_SCALE:
        scale = tl.load(base + (n0 // SCALE_BN) * stride_sn)
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        scale = tl.load(base + (offs_n // SCALE_BN) * stride_sn, mask=offs_n < N, other=0.0)[None, :]
    return scale


@triton.jit
def _dot(a, b, acc, UPCAST_DOT: tl.constexpr):
    if UPCAST_DOT:  # fp32 activations (exact, not tf32), or bf16 under the interpreter (see launcher)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _k_step(acc, acc_up, k0, a_ptr, a_rows, row_ok, w_base, scale_base, zero_base, g_idx_base, n0, offs_n, N, K, up_offset,
            stride_am, stride_wn, stride_wk, stride_sn, stride_sk, expert, scale_ptr, stride_se, a_scale_ptr,
            stride_asm, stride_asg, group_size: tl.constexpr, GATE_UP: tl.constexpr, KIND: tl.constexpr,
            BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, TILE_SCALE_ROW: tl.constexpr,
            SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, FP8_AS_BITS: tl.constexpr, UPCAST_DOT: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, MASK_N: tl.constexpr,
            A_GROUP: tl.constexpr, A_FP8: tl.constexpr, SCALE_PER_TILE: tl.constexpr, ONE_W_SCALE: tl.constexpr,
            WORD_DEQUANT: tl.constexpr, SCALE_AFTER_DOT: tl.constexpr, MXFP4_STEPS: tl.constexpr):
    """One K tile (rows k0 .. k0 + BLOCK_K) of the kernel's GEMM(s) into acc (and acc_up); MASK_K only for the
    ragged last tile."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a_mask = row_ok[:, None]
    if MASK_K:
        a_mask = a_mask & (offs_k[None, :] < K)
    a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=a_mask, other=0.0)
    COMPUTE = a_ptr.dtype.element_ty
    w = _load_weight_tile(w_base, scale_base, zero_base, g_idx_base, k0, offs_n, K, N, stride_wn, stride_wk,
                          stride_sn, stride_sk, group_size, KIND, BITS, HAS_ZEROS, HAS_G_IDX, TILE_SCALE_ROW, SCALE_BN,
                          SCALE_BK, FP8_AS_BITS, COMPUTE, BLOCK_K, MASK_K, MASK_N, A_FP8, WORD_DEQUANT,
                          SCALE_AFTER_DOT, MXFP4_STEPS)
    if A_FP8 and SCALE_PER_TILE:  # block scales: this K tile's partial sum, scaled by a_scale * w_scale
        a_scale = tl.load(a_scale_ptr + a_rows * stride_asm + (k0 // A_GROUP) * stride_asg, mask=row_ok, other=0.0)
        w_scale = _fp8_scale_row(scale_ptr, expert, k0, n0, N, stride_se, stride_sn, stride_sk,
                                 SCALE_BN, SCALE_BK, BLOCK_N, ONE_W_SCALE)
        acc += tl.dot(a, w) * (a_scale[:, None] * w_scale)
    elif SCALE_AFTER_DOT:  # exact q - zero in the dot, one multiply per output of the tile
        acc += _dot(a, w, tl.zeros(acc.shape, tl.float32), UPCAST_DOT) * _int4_scale_row(
            scale_base, k0, offs_n, N, stride_sn, stride_sk, group_size, MASK_N)
    else:
        acc = _dot(a, w, acc, UPCAST_DOT)
    if GATE_UP:
        w_up = _load_weight_tile(w_base, scale_base, zero_base, g_idx_base, k0, offs_n + up_offset, K, N + up_offset,
                                 stride_wn, stride_wk, stride_sn, stride_sk, group_size, KIND, BITS, HAS_ZEROS,
                                 HAS_G_IDX, TILE_SCALE_ROW, SCALE_BN, SCALE_BK, FP8_AS_BITS, COMPUTE, BLOCK_K, MASK_K,
                                 MASK_N, A_FP8, WORD_DEQUANT, SCALE_AFTER_DOT, MXFP4_STEPS)
        if A_FP8 and SCALE_PER_TILE:
            w_scale_up = _fp8_scale_row(scale_ptr, expert, k0, n0 + up_offset, N + up_offset,
                                        stride_se, stride_sn, stride_sk, SCALE_BN, SCALE_BK, BLOCK_N, ONE_W_SCALE)
            acc_up += tl.dot(a, w_up) * (a_scale[:, None] * w_scale_up)
        elif SCALE_AFTER_DOT:
            acc_up += _dot(a, w_up, tl.zeros(acc_up.shape, tl.float32), UPCAST_DOT) * _int4_scale_row(
                scale_base, k0, offs_n + up_offset, N + up_offset, stride_sn, stride_sk, group_size, MASK_N)
        else:
            acc_up = _dot(a, w_up, acc_up, UPCAST_DOT)
    return acc, acc_up


@triton.jit
def _moe_gemm_kernel(a_ptr, out_ptr, w_ptr, scale_ptr, zero_ptr, g_idx_ptr, routing_weight_ptr,
                     sorted_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
                     num_valid, N, K, up_offset, a_row_divisor,
                     stride_am, stride_om,
                     stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, group_size: tl.constexpr,
                     GATE_UP: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                     HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, TILE_SCALE_ROW: tl.constexpr,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, FP8_AS_BITS: tl.constexpr,
                     UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     bias_ptr, stride_be, swiglu_alpha, swiglu_limit, HAS_BIAS: tl.constexpr = False,
                     CLAMPED_SWIGLU: tl.constexpr = False, a_scale_ptr=None, stride_asm=0, stride_asg=0,
                     A_GROUP: tl.constexpr = 1, A_FP8: tl.constexpr = False, SCALE_PER_TILE: tl.constexpr = False,
                     ONE_W_SCALE: tl.constexpr = False, WORD_DEQUANT: tl.constexpr = False,
                     MASK_K: tl.constexpr = True, MASK_N: tl.constexpr = True, SCALE_AFTER_DOT: tl.constexpr = False,
                     MXFP4_STEPS: tl.constexpr = 2, sum_ptr=None, topk_ids_ptr=None, arrivals_ptr=None, top_k=1,
                     SUM_SLOTS: tl.constexpr = False, PART: tl.constexpr = False):
    """One program: BLOCK_M sorted rows (one expert) x BLOCK_N output columns.

    A row of sorted row r is sorted_ids[r] // a_row_divisor (the token for gate/up, the
    (token, slot) row itself for down); the output row is sorted_ids[r].
    GATE_UP: out[:, n] = silu(A @ W[n]) * (A @ W[n + up_offset]); PART (the gate or the up of experts whose gate and
    up differ in type): out = A @ W^T; else out = w_route * (A @ W^T).
    HAS_BIAS: bias [E, N (+ up_offset)] (stride_be per expert) added to each GEMM output first;
    CLAMPED_SWIGLU: gpt-oss's activation (`ClampedSwiGLU`) in place of SiLU-and-mul.
    A_FP8 (W8A8, fp8 experts on sm_89+): A is e4m3 with fp32 scales a_scale[row, k // A_GROUP] (strides 0 for a
    static scale), W the e4m3 codes; e4m3 x e4m3 dots accumulate in fp32. Block-scaled weights (SCALE_PER_TILE:
    BLOCK_K divides SCALE_BK = A_GROUP) scale each K tile's partial sum by a_scale * w_scale; per-tensor /
    per-channel weights scale the accumulators once, after the K loop. ONE_W_SCALE: every N tile (the up
    half's too) lies inside one weight scale block (`_fp8_scale_row`).
    WORD_DEQUANT: int4 / MXFP4 codes decoded from 32-bit words (`_load_weight_tile`); SCALE_AFTER_DOT: the int4
    scale row multiplies each K tile's dot result; MXFP4_STEPS: `common.mxfp4_words_to_half`'s.
    MASK_K / MASK_N: K / N are not multiples of BLOCK_K / BLOCK_N. The loop runs the whole K tiles unmasked and
    the ragged last one after it, masked; N is masked only where it is ragged. Expert base pointers: once.
    SUM_SLOTS (down): out holds the weighted (token, slot) rows [T * top_k, N] and sum [T, N] their sum over each
    token's slots, by the last row block of each column tile (`common.sum_expert_slots`; topk_ids [T, top_k] for
    the slots computed here, arrivals one int32 zero per column tile). The first row block arrives even when no
    block runs (every slot is another rank's), so that sum's rows are always written.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    post_padded = tl.load(num_tokens_post_padded_ptr)
    stop = pid_m * BLOCK_M >= post_padded  # past the last padded expert run: max_blocks is only an upper bound
    if SUM_SLOTS:  # the first row block arrives at the slot sum in any case
        stop = stop & (pid_m > 0)
    if stop:
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_ok = (rows < num_valid) & (offs_m < post_padded)  # padding slots hold the sentinel num_valid
    a_rows = (rows // a_row_divisor).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert * stride_we
    scale_base = scale_ptr + expert * stride_se
    zero_base = zero_ptr + expert * stride_se
    g_idx_base = g_idx_ptr + expert * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_whole = K // BLOCK_K * BLOCK_K
    for k0 in range(0, k_whole, BLOCK_K):
        acc, acc_up = _k_step(acc, acc_up, k0, a_ptr, a_rows, row_ok, w_base, scale_base, zero_base, g_idx_base,
                              pid_n * BLOCK_N, offs_n, N, K, up_offset, stride_am, stride_wn, stride_wk, stride_sn, stride_sk, expert,
                              scale_ptr, stride_se, a_scale_ptr, stride_asm, stride_asg, group_size, GATE_UP, KIND,
                              BITS, HAS_ZEROS, HAS_G_IDX, TILE_SCALE_ROW, SCALE_BN, SCALE_BK, FP8_AS_BITS, UPCAST_DOT,
                              BLOCK_N, BLOCK_K, False, MASK_N, A_GROUP, A_FP8, SCALE_PER_TILE, ONE_W_SCALE,
                              WORD_DEQUANT, SCALE_AFTER_DOT, MXFP4_STEPS)
    if MASK_K:
        acc, acc_up = _k_step(acc, acc_up, k_whole, a_ptr, a_rows, row_ok, w_base, scale_base, zero_base, g_idx_base,
                              pid_n * BLOCK_N, offs_n, N, K, up_offset, stride_am, stride_wn, stride_wk, stride_sn, stride_sk, expert,
                              scale_ptr, stride_se, a_scale_ptr, stride_asm, stride_asg, group_size, GATE_UP, KIND,
                              BITS, HAS_ZEROS, HAS_G_IDX, TILE_SCALE_ROW, SCALE_BN, SCALE_BK, FP8_AS_BITS, UPCAST_DOT,
                              BLOCK_N, BLOCK_K, True, MASK_N, A_GROUP, A_FP8, SCALE_PER_TILE, ONE_W_SCALE,
                              WORD_DEQUANT, SCALE_AFTER_DOT, MXFP4_STEPS)
    if A_FP8 and not SCALE_PER_TILE:  # per-token (or static) and per-tensor / per-channel scales: constant along K
        a_scale = tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_ok, other=0.0)[:, None]
        acc *= a_scale * _fp8_scale_row(scale_ptr, expert, 0, pid_n * BLOCK_N, N, stride_se, stride_sn, stride_sk,
                                        SCALE_BN, SCALE_BK, BLOCK_N, ONE_W_SCALE)
        if GATE_UP:
            acc_up *= a_scale * _fp8_scale_row(scale_ptr, expert, 0, pid_n * BLOCK_N + up_offset, N + up_offset,
                                               stride_se, stride_sn, stride_sk, SCALE_BN, SCALE_BK, BLOCK_N, ONE_W_SCALE)
    if HAS_BIAS:
        bias_row = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(bias_row + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if GATE_UP:
            acc_up += tl.load(bias_row + up_offset + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if GATE_UP:
        if CLAMPED_SWIGLU:  # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            gate = tl.minimum(acc, swiglu_limit)
            up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
            acc = gate / (1.0 + tl.exp(-swiglu_alpha * gate)) * (up + 1.0)
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, in fp32
    elif not PART:
        acc = acc * tl.load(routing_weight_ptr + rows, mask=row_ok, other=0.0)[:, None]
    out_mask = row_ok[:, None] & (offs_n[None, :] < N)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    if SUM_SLOTS:
        sum_expert_slots(out_ptr, sum_ptr, topk_ids_ptr, arrivals_ptr, pid_n, offs_n, N, num_valid // top_k, top_k,
                         tl.maximum(post_padded // BLOCK_M, 1), BLOCK_M)
