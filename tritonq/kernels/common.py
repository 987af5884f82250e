"""What every kernel family shares: @triton.jit pieces, the launch-config convention, one launch object.

@triton.jit helpers (called from the kernels, inlined by Triton):
  unpack_int_tile      int32 words packed along K -> int32 codes (int4_gemm, moe)
  dequantize_int_tile  int32 codes -> (q - zero) * scale in the compute dtype, by magic-number floats
                       (no int-to-float conversion; int4_gemm, moe)
  int4_words_to_magic  4-bit codes straight from the packed words to magic + q half pairs by inline PTX (one
                       prmt and one lop3 per two codes; GPU from sm_80, `int4_word_dequant`)
  int4_words_minus_zero  its q - zero, exactly (int4_gemm, moe)
  high_words_to_magic  the same for 5- / 6-bit codes split into a 4-bit plane and a plane of the bits above
                       (gguf_gemm's Q5 / Q6_K decode path)
  int8_words_minus_zero  the same for 8-bit codes (`int8_words_to_halves`: one prmt per two codes into fp16
                       pairs; bf16 from two exact pieces a code; int4_gemm, `int8_word_dequant`)
  e2m1_bits_to_fp16    MXFP4 (e2m1) codes -> fp16 / 2^14 with integer ops (moe's mxfp4 experts)
  mxfp4_words_to_half  8 e2m1 codes a word times their E8M0 scale, in bf16 / fp16, by inline PTX (byte lookups
                       and packed FMAs; GPU from sm_80, `mxfp4_word_decode`; moe's mxfp4 experts)
  e4m3_bits_to_fp16    float8_e4m3fn bytes -> fp16 / 2^8 with integer ops, for GPUs without fp8
                       types (fp8_gemm's weight-only path, moe's fp8 experts, the fp8 KV cache)
  e4m3_words_to_halves the same 4 bytes a word by inline PTX, fp16 / bf16 (fp8_gemm's weight-only path from sm_80)
  round_to_e4m3        fp32 -> the nearest e4m3 value, still fp32 (fp8_gemm's activations)
  e4m3_bits_from_fp32  fp32 -> e4m3 bytes with integer ops (the fp8 KV cache's write, any GPU)
  ieee_dot             tl.dot that multiplies fp32 operands in IEEE fp32, not tf32 (attention,
                       fp8_gemm's weight-only path; int4_gemm and moe upcast via UPCAST_DOT)
  activation_scale     per-token / per-group activation scale (fp8_gemm's and int8_gemm's quantizers)
  divide_by_scale      x / scale as IEEE division rounds it, by one reciprocal per scale (the same quantizers)
  rows_absmax          a row's (or group's) max |x| inside a GEMM that quantizes its activations itself
  broadcast_rows       such a GEMM's quantized rows (the M bucket's) copied up to the dot's BLOCK_M rows
  gemm_tile / k_tile_mask / activation_rows / store_gemm_tile
                       the GemmConfig kernels' (fp8_gemm, int8_gemm) tile in grouped order, K slice, a K tile's
                       mask (int8_gemm's), the rows of x it reads (the M bucket's where it quantizes x itself) and
                       epilogue (bias on the first slice, then y or the split-K sum, or
                       the residual + RMSNorm epilogue)
  reduce_split_k       the split-K sum in the GEMM's own launch: the last K slice to arrive adds the
                       slices' fp32 partials in slice order and stores y (int4_gemm, store_gemm_tile)
  sum_expert_slots     the sum over a token's k expert slots in the MoE down GEMM's own launch: the last row
                       block of a column tile to arrive adds each token's slot rows in slot order (moe, gguf_gemm)
  store_output         a GEMM's output tile to y, or with SILU_MUL SwiGLU's silu(gate) * up of its
                       interleaved (gate, up) column pairs: the gate_up linear's epilogue
  add_rms_norm_tile    y = a GEMM's tile + the residual, and the RMSNorm of y's whole rows by the row
                       block's last tile: o_proj's epilogue (int4_gemm, dense_gemm, store_gemm_tile)
The attention kernels' online-softmax step is `attention._attend_tile`, shared by all three of them.

Launch configs (the one convention): a frozen dataclass per kernel whose tile fields are named as the
kernel's constexpr parameters (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GROUP_M, NUM_SPLITS) and whose
launch options are named as Triton's (num_warps, num_stages). Tuned JSON entries
(configs/<kernel>/<gpu>.json) use the same names, so `tuned_or_default` overlays one on the default
and `check_launch_config` checks any of them.

The dense-GEMM families with activation quantization (fp8_gemm, int8_gemm) share their launch shape: a
`GemmConfig` (tiles, GROUP_M swizzle, SPLIT_K), one program per output tile and K slice (`gemm_grid`), split-K
partials in an fp32 [SPLIT_K, M, N] buffer (`gemm_output`), buckets keyed by (M rounded up, N, K)
(`gemm_config_bucket`), and the decode split (`decode_split_k`). Every split-K GEMM (int4_gemm too) sums its
slices inside its own launch (`reduce_split_k`): one launch per GEMM.

Launch: a kernel's launcher builds a `Launch` (grid + every argument by parameter name) with a builder
in the kernel's own file, then calls it (on its tensors' CUDA device, whatever the thread's current
one). The GEMMs build theirs once per (weight, M bucket) and keep it in a `GemmPlan`, which binds
the per-call arguments (activations, output, M) at each call. `tritonq.tune --aot` builds the same
object over "meta" tensors (shapes, strides and dtypes without memory) and compiles it
(`kernels.aot.compile_launch`), so no kernel signature is written down anywhere else. Meta tensors
stand for a GPU: `on_gpu`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import weakref
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import triton
import triton.language as tl

from tritonq.kernels import backend, batch_invariant
from tritonq.kernels.configs import lookup

log = logging.getLogger(__name__)

# 2^8: the exponent-bias difference between fp16 (15) and e4m3 (7), see e4m3_bits_to_fp16; a
# tl.constexpr so that @triton.jit code can read it.
E4M3_TO_FP16_BIAS = tl.constexpr(256.0)
# Whether @triton.jit functions run in Triton's interpreter (TRITON_INTERPRET=1, read by @triton.jit when this
# module is imported, as here): the few bit tricks the interpreter mis-computes take a plain path there.
INTERPRETED = tl.constexpr(triton.knobs.runtime.interpret)


@triton.jit
def unpack_int_tile(words, BITS: tl.constexpr):
    """words [BLOCK_K * BITS / 32, BLOCK_N] int32, packed along K -> int32 codes [BLOCK_K, BLOCK_N].

    Field i of word r is row r * (32 / BITS) + i, so the reshape keeps rows in K order: each packed
    word is loaded once and unpacked in registers (a shift and a mask per code; the mask fuses with
    `dequantize_int_tile`'s OR into one LOP3). Unpack right after the load: the kernels keep the
    words' registers short-lived that way (sm_75 spills more when scale loads come in between).
    """
    PER_WORD: tl.constexpr = 32 // BITS
    fields = (words[:, None, :] >> (tl.arange(0, PER_WORD) * BITS)[None, :, None]) & ((1 << BITS) - 1)
    return tl.reshape(fields, (words.shape[0] * PER_WORD, words.shape[1]))


@triton.jit
def dequantize_int_tile(q, scale, zero, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, DTYPE: tl.constexpr):
    """int32 codes q [BLOCK_K, BLOCK_N] (`unpack_int_tile`) -> weights (q - zero) * scale in DTYPE, with no
    int-to-float conversion; zero and scale (as loaded, integer-valued zeros) broadcast against the tile
    ([1, BLOCK_N] rows or full tiles); without HAS_ZEROS zero is 2^(BITS-1) and `zero` is not read.

    The code is ORed into the mantissa of a float whose exponent makes its ulp 1: fp16 0x6400 | q is
    1024 + q, bf16 0x4300 | q is 128 + q (codes < 128), fp32 0x4B000000 | q is 2^23 + q. Subtracting
    magic + zero (an integer, exact) gives q - zero exactly, and the scale multiply rounds once: the
    same bits as the fp32 (q - zero) * scale rounded to DTYPE. Half math runs where the scales are in
    DTYPE already; otherwise (fp32 scales or activations, 8-bit codes in bf16) in fp32, then cast.
    Triton's interpreter computes on bitcast bf16 as raw bits: there bf16 takes the fp32 path (same values).
    """
    if DTYPE == tl.float16 and scale.dtype == tl.float16:
        h = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        magic: tl.constexpr = 1024.0
    elif DTYPE == tl.bfloat16 and scale.dtype == tl.bfloat16 and BITS <= 7 and not INTERPRETED:
        h = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        magic: tl.constexpr = 128.0
    else:
        h = (q | 0x4B000000).to(tl.float32, bitcast=True)
        magic: tl.constexpr = 8388608.0
        scale = scale.to(tl.float32)
        zero = zero.to(tl.float32)
    if HAS_ZEROS:
        w = (h - (zero + magic)) * scale
    else:
        w = (h - (magic + (1 << (BITS - 1)))) * scale
    return w.to(DTYPE)


# PTX of `int4_words_to_magic` on word $8 (fields n0..n7, n0 lowest): t = $8 >> 4 has n(2i+1) in the low nibble
# of its byte i, where $8 has n(2i); a prmt moves byte i of each into the two 16-bit halves and one lop3 ((a & b)
# | c: 0xEA) keeps the low nibbles and ORs in the bits of two magic floats (0x6400: fp16 1024, 0x4300: bf16 128):
# pair i = {magic + n(2i), magic + n(2i+1)}, two consecutive rows in one register (FasterTransformer's and
# Marlin's LOP3 trick, with the prmt in place of their interleaved repacking).
_INT4_MAGIC_PTX = """{
.reg .b32 t, p0, p1, p2, p3;
shr.u32 t, $8, 4;
prmt.b32 p0, $8, t, 0x0400;
prmt.b32 p1, $8, t, 0x0501;
prmt.b32 p2, $8, t, 0x0602;
prmt.b32 p3, $8, t, 0x0703;
lop3.b32 p0, p0, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p1, p1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p2, p2, 0x000F000F, MAGIC, 0xEA;
lop3.b32 p3, p3, 0x000F000F, MAGIC, 0xEA;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
mov.b32 {$4, $5}, p2;
mov.b32 {$6, $7}, p3;
}"""
INT4_FP16_MAGIC_PTX = tl.constexpr(_INT4_MAGIC_PTX.replace("MAGIC", "0x64006400"))
INT4_BF16_MAGIC_PTX = tl.constexpr(_INT4_MAGIC_PTX.replace("MAGIC", "0x43004300"))


@triton.jit
def _magic_code(words, SHIFT: tl.constexpr, DTYPE: tl.constexpr):
    """The 4-bit field at SHIFT of each word, ORed into the mantissa of fp16's magic number (the interpreter's
    path of `int4_words_to_magic`; it misreads bitcast bf16, so fp16 only)."""
    return (((words >> SHIFT) & 15) | 0x6400).to(tl.int16).to(DTYPE, bitcast=True)


@triton.jit
def int4_words_to_magic(words, DTYPE: tl.constexpr):
    """int32 words [R, C], packed along K as `unpack_int_tile` reads them (field i of word r is row 8 r + i) ->
    magic + q in DTYPE [8 R, C] (fp16 1024 + q, bf16 128 + q). On a GPU one PTX block per word
    (INT4_*_MAGIC_PTX: one shift, and per two codes one prmt and one lop3) leaves rows 2i, 2i + 1 packed in one
    register, as the half2 math and the dot's shared-memory stores take them: nothing is unpacked per code.
    The interpreter builds the same values field by field. The interleaves put output j of word r at row
    8 r + j; the transposes make a word's 8 rows one thread's consecutive elements."""
    wt = tl.trans(words)  # [C, R]: the new rows are interleaved along the last axis
    if INTERPRETED:
        o0 = _magic_code(wt, 0, DTYPE)
        o1 = _magic_code(wt, 4, DTYPE)
        o2 = _magic_code(wt, 8, DTYPE)
        o3 = _magic_code(wt, 12, DTYPE)
        o4 = _magic_code(wt, 16, DTYPE)
        o5 = _magic_code(wt, 20, DTYPE)
        o6 = _magic_code(wt, 24, DTYPE)
        o7 = _magic_code(wt, 28, DTYPE)
    elif DTYPE == tl.float16:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            INT4_FP16_MAGIC_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r", [wt], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
            INT4_BF16_MAGIC_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r", [wt], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return _word_rows(o0, o1, o2, o3, o4, o5, o6, o7)


@triton.jit
def _word_rows(o0, o1, o2, o3, o4, o5, o6, o7):
    """Outputs j = 0..7 [C, R] of a per-word decode (of the transposed words) -> rows 8 r + j: [8 R, C]."""
    even = tl.interleave(tl.interleave(o0, o4), tl.interleave(o2, o6))  # rows 8 r + 0, 2, 4, 6
    odd = tl.interleave(tl.interleave(o1, o5), tl.interleave(o3, o7))
    return tl.trans(tl.interleave(even, odd))


# PTX of `high_words_to_magic` on word $8 of the 4-bit plane (fields n0..n7) and $9, the word of the high plane that
# holds the same 8 codes' high bits (1 bit a code: bits $10 + i, $10 the shift to the word's byte; 2 bits a code: the
# fields of the half that prmt selector $13 picks, $10..$12 = $9 << 4, << 2, >> 2). Two words are formed whose byte
# i holds code 2i (a: $8's low nibbles) and code 2i + 1 (b: t = $8 >> 4), the high bits placed at bit 4 of each
# byte by a select (lop3 0xD8: (b & c) | (a & ~c)); then int4's prmt and lop3 per pair, with a 5- or 6-bit mask.
# 1 bit: the even (odd) bits of the code's byte go to bit 8i + 4 by one multiply (0x410410: shifts 4, 10, 16, 22;
# 0x208208: 3, 9, 15, 21), whose overlapping copies carry only into odd bits, never into a bit 8i + 4. 2 bits: byte
# k's fields at bits 0, 2, 4, 6 reach bits 4-5 of a byte of h << 4, h << 2, h and h >> 2; one prmt per word picks
# the bytes.
_HIGH_SPREAD = {1: """shr.u32 h, $9, $10;
and.b32 e, h, 0x55;
and.b32 o, h, 0xAA;
mul.lo.u32 e, e, 0x410410;
mul.lo.u32 o, o, 0x208208;
""", 2: """prmt.b32 e, $9, $10, $13;
prmt.b32 o, $12, $11, $13;
"""}
_HIGH_MAGIC_PTX = """{
.reg .b32 t, h, e, o, a, b, p0, p1, p2, p3;
shr.u32 t, $8, 4;
SPREAD
lop3.b32 a, $8, e, HIGH_BITS, 0xD8;
lop3.b32 b, t, o, HIGH_BITS, 0xD8;
prmt.b32 p0, a, b, 0x0400;
prmt.b32 p1, a, b, 0x0501;
prmt.b32 p2, a, b, 0x0602;
prmt.b32 p3, a, b, 0x0703;
lop3.b32 p0, p0, CODE_BITS, MAGIC, 0xEA;
lop3.b32 p1, p1, CODE_BITS, MAGIC, 0xEA;
lop3.b32 p2, p2, CODE_BITS, MAGIC, 0xEA;
lop3.b32 p3, p3, CODE_BITS, MAGIC, 0xEA;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
mov.b32 {$4, $5}, p2;
mov.b32 {$6, $7}, p3;
}"""


def _high_magic_ptx(high: int, magic: str) -> str:
    """The PTX block of `high_words_to_magic` for `high` bits above the nibble and one dtype's magic pair."""
    return (_HIGH_MAGIC_PTX.replace("SPREAD\n", _HIGH_SPREAD[high]).replace("MAGIC", magic)
            .replace("HIGH_BITS", ("0x10101010", "0x30303030")[high - 1])
            .replace("CODE_BITS", ("0x001F001F", "0x003F003F")[high - 1]))


HIGH1_FP16_MAGIC_PTX = tl.constexpr(_high_magic_ptx(1, "0x64006400"))
HIGH1_BF16_MAGIC_PTX = tl.constexpr(_high_magic_ptx(1, "0x43004300"))
HIGH2_FP16_MAGIC_PTX = tl.constexpr(_high_magic_ptx(2, "0x64006400"))
HIGH2_BF16_MAGIC_PTX = tl.constexpr(_high_magic_ptx(2, "0x43004300"))


@triton.jit
def _magic_high_code(words, high, shift, J: tl.constexpr, HIGH: tl.constexpr, DTYPE: tl.constexpr):
    """Code J of each word (its nibble, and its HIGH bits at bit shift + J * HIGH of `high`) ORed into fp16's magic
    number (the interpreter's path of `high_words_to_magic`; fp16 only, as `_magic_code`)."""
    q = ((words >> (4 * J)) & 15) | (((high >> (shift + J * HIGH)) & ((1 << HIGH) - 1)) << 4)
    return (q | 0x6400).to(tl.int16).to(DTYPE, bitcast=True)


@triton.jit
def _per_high_word(high, F: tl.constexpr):
    """high [G, C] -> [C, F G]: each word of the high plane for the F words of the 4-bit plane it serves, transposed as
    `high_words_to_magic` takes the words (broadcast in registers)."""
    G: tl.constexpr = high.shape[0]
    C: tl.constexpr = high.shape[1]
    return tl.trans(tl.reshape(tl.broadcast_to(high[:, None, :], (G, F, C)), (G * F, C)))


@triton.jit
def high_words_to_magic(words, high, HIGH: tl.constexpr, DTYPE: tl.constexpr):
    """5- or 6-bit codes from a 4-bit plane and a plane of their HIGH (1 or 2) bits above it (GGUF's Q5 / Q6_K
    planes): words [R, C] as `int4_words_to_magic` takes them, high [R * HIGH / 4, C] packed along K (field i of word
    r is row 32 r / HIGH + i) -> magic + q in DTYPE [8 R, C] (q < 64: exact under both magics), rows as
    `int4_words_to_magic` places them. On a GPU one PTX block per word (HIGH*_*_MAGIC_PTX: int4's prmt and lop3
    per two codes, and per word the high bits set into the nibbles' bytes); the interpreter builds the values field
    by field. Each high word serves 4 / HIGH words, broadcast in registers."""
    F: tl.constexpr = 4 // HIGH  # words of the 4-bit plane per word of the high plane
    R: tl.constexpr = words.shape[0]
    part = (tl.arange(0, R) % F)[None, :]  # the byte (HIGH 1) or half (HIGH 2) of its high word a word takes
    wt = tl.trans(words)
    ht = _per_high_word(high, F)
    if INTERPRETED:
        shift = part * (8 * HIGH)
        o0 = _magic_high_code(wt, ht, shift, 0, HIGH, DTYPE)
        o1 = _magic_high_code(wt, ht, shift, 1, HIGH, DTYPE)
        o2 = _magic_high_code(wt, ht, shift, 2, HIGH, DTYPE)
        o3 = _magic_high_code(wt, ht, shift, 3, HIGH, DTYPE)
        o4 = _magic_high_code(wt, ht, shift, 4, HIGH, DTYPE)
        o5 = _magic_high_code(wt, ht, shift, 5, HIGH, DTYPE)
        o6 = _magic_high_code(wt, ht, shift, 6, HIGH, DTYPE)
        o7 = _magic_high_code(wt, ht, shift, 7, HIGH, DTYPE)
    elif HIGH == 1:  # with the shift to the word's byte
        if DTYPE == tl.float16:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                HIGH1_FP16_MAGIC_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [wt, ht, part * 8], dtype=(tl.float16,) * 8,
                is_pure=True, pack=1)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                HIGH1_BF16_MAGIC_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [wt, ht, part * 8], dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
    else:  # h << 4, h << 2, h >> 2 once per high word (shared by its two words), and the selector of the word's half
        spread = [wt, ht, _per_high_word(high << 4, F), _per_high_word(high << 2, F), _per_high_word(high >> 2, F),
                  0x1504 + part * 0x2222]
        if DTYPE == tl.float16:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                HIGH2_FP16_MAGIC_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r", spread, dtype=(tl.float16,) * 8,
                is_pure=True, pack=1)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                HIGH2_BF16_MAGIC_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r", spread, dtype=(tl.bfloat16,) * 8,
                is_pure=True, pack=1)
    return _word_rows(o0, o1, o2, o3, o4, o5, o6, o7)


@triton.jit
def int4_words_minus_zero(words, zero, HAS_ZEROS: tl.constexpr, DTYPE: tl.constexpr):
    """int32 words [BLOCK_K / 8, BLOCK_N] -> q - zero in DTYPE (fp16 / bf16) [BLOCK_K, BLOCK_N], exactly: magic + q (`int4_words_to_magic`) minus magic + zero, integers DTYPE holds (zero:
    integer-valued, in DTYPE, broadcasting against the tile; without HAS_ZEROS 8 and `zero`
    is not read). The caller multiplies the scale: per weight (one rounding, as `dequantize_int_tile`) or, where
    the tile has one row of scales, on the dot's fp32 result (the dot then sees exact integers)."""
    h = int4_words_to_magic(words, DTYPE)
    if DTYPE == tl.float16:
        magic: tl.constexpr = 1024.0
    else:
        magic: tl.constexpr = 128.0
    if HAS_ZEROS:
        return h - (zero + magic)
    return h - (magic + 8)


# PTX of `int8_words_to_halves` on word $4 (bytes b0..b3, b0 lowest), two consecutive rows per register. fp16: a
# prmt of the word with 0x64646464 per two codes gives {0x6400 | b(2i), 0x6400 | b(2i+1)} = {1024 + b(2i),
# 1024 + b(2i+1)}. bf16's 7 mantissa bits cannot hold a byte, so each code b = l + 128 h (l: its low 7 bits, h: its
# top bit) is made from two exact bf16 pieces and one packed add: a prmt puts b(2i), b(2i+1) in the low bytes of the
# two halves, one lop3 keeps l and ORs in 0x4300 (128 + l), another ORs the inverted h into 0xC300 (0xC380 = -256
# for h = 0, 0xC300 = -128 for h = 1: -256 + 128 h), and one fma by 1 adds them: q - 128 in [-128, 127], exact.
INT8_FP16_PTX = tl.constexpr("""{
.reg .b32 p0, p1;
prmt.b32 p0, $4, 0x64646464, 0x4140;
prmt.b32 p1, $4, 0x64646464, 0x4342;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
}""")
_INT8_BF16_PAIR = """prmt.b32 p, $4, 0, SELECTOR;
lop3.b32 l, p, 0x007F007F, 0x43004300, 0xEA;
lop3.b32 h, p, 0x00800080, 0xC300C300, 0xAE;
fma.rn.bf16x2 pI, l, one, h;
"""
INT8_BF16_PTX = tl.constexpr("""{
.reg .b32 p, l, h, one, p0, p1;
mov.b32 one, 0x3F803F80;
""" + _INT8_BF16_PAIR.replace("SELECTOR", "0x4140").replace("pI", "p0")
    + _INT8_BF16_PAIR.replace("SELECTOR", "0x4342").replace("pI", "p1") + """mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
}""")


@triton.jit
def _magic_byte(words, SHIFT: tl.constexpr):
    """The byte at SHIFT of each word, ORed into the mantissa of fp16's magic number (the interpreter's path of
    `int8_words_to_halves`)."""
    return (((words >> SHIFT) & 255) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def int8_words_to_halves(words, DTYPE: tl.constexpr):
    """int32 words [R, C], packed along K (byte i of word r is row 4 r + i) -> [4 R, C] in DTYPE: 1024 + q in
    fp16 (the magic number), q - 128 in bf16 (two exact pieces added: a byte does not fit bf16's mantissa). On a GPU
    one PTX block per word (INT8_FP16_PTX / INT8_BF16_PTX), no shifts; the interpreter builds the fp16 values
    field by field (it runs fp16 only, `int8_word_dequant`). The interleaves put output j of word r at row
    4 r + j, as in `int4_words_to_magic`."""
    wt = tl.trans(words)
    if INTERPRETED:
        o0 = _magic_byte(wt, 0)
        o1 = _magic_byte(wt, 8)
        o2 = _magic_byte(wt, 16)
        o3 = _magic_byte(wt, 24)
    elif DTYPE == tl.float16:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            INT8_FP16_PTX, "=h,=h,=h,=h,r", [wt], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            INT8_BF16_PTX, "=h,=h,=h,=h,r", [wt], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
    return tl.trans(tl.interleave(tl.interleave(o0, o2), tl.interleave(o1, o3)))


@triton.jit
def int8_words_minus_zero(words, zero, HAS_ZEROS: tl.constexpr, DTYPE: tl.constexpr):
    """int32 words [BLOCK_K / 4, BLOCK_N] of 8-bit codes -> q - zero in DTYPE (fp16 / bf16) [BLOCK_K, BLOCK_N],
    exactly, as `int4_words_minus_zero` (zero: integer-valued, in DTYPE; without HAS_ZEROS 128, and `zero` is not
    read): from `int8_words_to_halves`, fp16 subtracts 1024 + zero, bf16 (q - 128) nothing or zero - 128 (both
    operands and the difference are integers of at most 8 significant bits: exact)."""
    h = int8_words_to_halves(words, DTYPE)
    if DTYPE == tl.float16:
        if HAS_ZEROS:
            return h - (zero + 1024.0)
        return h - 1152.0
    if HAS_ZEROS:
        return h - (zero - 128.0)
    return h


# Splits a 32-bit pair-table entry into its two 16-bit halves (no instruction: a register pair view).
PAIR_SPLIT_PTX = tl.constexpr("mov.b32 {$0, $1}, $2;")


@triton.jit
def _split_pair(p, DTYPE: tl.constexpr):
    """int32 p -> (its low half, its high half) read as DTYPE."""
    if INTERPRETED:
        return (p & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True), (p >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    elif DTYPE == tl.float16:
        return tl.inline_asm_elementwise(PAIR_SPLIT_PTX, "=h,=h,r", [p], dtype=(tl.float16, tl.float16), is_pure=True,
                                         pack=1)
    else:
        return tl.inline_asm_elementwise(PAIR_SPLIT_PTX, "=h,=h,r", [p], dtype=(tl.bfloat16, tl.bfloat16),
                                         is_pure=True, pack=1)


# PTX of `code_pairs_lookup` on word $4: output i is byte i of the word, zero-extended, by one prmt: the pair table's
# index. Written as a shift and a mask, the compiler folds the gather's x4 into them (two instructions a byte); from
# the prmt, sm_80's shared load scales the index itself (`LDS [R.X4]`).
WORD_BYTES_PTX = tl.constexpr("""{
prmt.b32 $0, $4, 0, 0x4440;
prmt.b32 $1, $4, 0, 0x4441;
prmt.b32 $2, $4, 0, 0x4442;
prmt.b32 $3, $4, 0, 0x4443;
}""")


@triton.jit
def code_pairs_lookup(words, pairs, DTYPE: tl.constexpr):
    """int32 words [R, C] of 4-bit codes packed along K (field i of word r is row 8 r + i) -> code[q] in DTYPE
    [8 R, C], through the 256-entry table of pairs `pairs` (int32 [256], `code_pair_table`, loaded once by the
    caller): byte i of a word indexes entry {code[low nibble], code[high nibble]}. The lookup is one tl.gather, which
    stores the table in shared memory (1 KB) and reads one entry a byte there: no per-code unpack, no 64-bit address.
    The bytes come by WORD_BYTES_PTX, the entries split into halves by a register view (PAIR_SPLIT_PTX); the
    interpreter (fp16 only) takes shifts for both. Rows as `int4_words_to_magic` places them."""
    wt = tl.trans(words)
    C: tl.constexpr = wt.shape[0]
    R: tl.constexpr = wt.shape[1]
    if INTERPRETED:
        b0, b1, b2, b3 = wt & 255, (wt >> 8) & 255, (wt >> 16) & 255, (wt >> 24) & 255
    else:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(WORD_BYTES_PTX, "=r,=r,=r,=r,r", [wt], dtype=(tl.int32,) * 4,
                                                   is_pure=True, pack=1)
    idx = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [C, R, 2, 2]: byte i of word (c, r) at [c, r, i // 2, i % 2]
    lo, hi = _split_pair(tl.gather(pairs, tl.reshape(idx, (C * R * 4,)), 0), DTYPE)
    return tl.trans(tl.reshape(tl.join(lo, hi), (C, 8 * R)))  # [c, 8 r + 2 i + h]: half h of byte i's entry


# PTX of `mxfp4_words_to_half` on word $8 (e2m1 codes c0..c7, c0 lowest; code = sign, 2 exponent bits, 1 mantissa
# bit) and the group's scale factors $9 (and $10) as half pairs. The codes' bits are placed, not converted: in bf16
# sign << 15 | (exponent, mantissa) << 6 reads as the e2m1 value x 2^-126, in fp16 sign << 15 | (exponent, mantissa)
# << 9 as the value x 2^-14 (0.5 a subnormal in both). Each half's two bytes come from byte lookups in 4-byte tables
# held in registers, by 2-bit selectors: prmt with 4 selectors looks up 4 codes at once. bf16: the low byte depends on
# the code's bottom two bits (LO: 0x00, 0x40, 0x80, 0xC0), the high byte on its top two (HI: 0x00, 0x01, 0x80, 0x81);
# per two codes one prmt interleaves them into a pair. fp16: the low byte is 0 and the high byte is an or of a
# bottom-two-bits (0x00, 0x02, 0x04, 0x06) and a top-two-bits (0x00, 0x08, 0x80, 0x88) lookup, placed by one prmt per
# two codes. Then one packed FMA with -0 (exact, subnormals kept) per scale factor: one when every scale of the
# weight is at most 2^1 (`mxfp4_scale_factors`), two otherwise.
_MXFP4_SELECTORS = """{
.reg .b32 a, b, l, h, t, p0, p1, p2, p3, lo, hi, nz, z;
mov.b32 lo, LO;
mov.b32 hi, HI;
mov.b32 nz, 0x80008000;
mov.b32 z, 0;
lop3.b32 a, $8, 0x33333333, 0x44444444, 0xEA;
shr.u32 b, $8, 2;
lop3.b32 b, b, 0x33333333, 0x44444444, 0xEA;
"""
_MXFP4_BF16_PAIRS = """prmt.b32 l, z, lo, a;
prmt.b32 h, z, hi, b;
prmt.b32 pI, l, h, 0x5140;
prmt.b32 pJ, l, h, 0x7362;
"""
_MXFP4_FP16_PAIRS = """prmt.b32 l, z, lo, a;
prmt.b32 h, z, hi, b;
or.b32 t, l, h;
prmt.b32 pI, t, 0, 0x1404;
prmt.b32 pJ, t, 0, 0x3424;
"""
_MXFP4_OUT = """mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
mov.b32 {$4, $5}, p2;
mov.b32 {$6, $7}, p3;
}"""


def _mxfp4_ptx(fp16: bool, steps: int) -> str:
    """The PTX block of `mxfp4_words_to_half` for one dtype and number of scale factors (see above)."""
    pairs = _MXFP4_FP16_PAIRS if fp16 else _MXFP4_BF16_PAIRS
    tables = ("0x06040200", "0x88800800") if fp16 else ("0xC0804000", "0x81800100")
    fma = "fma.rn.f16x2" if fp16 else "fma.rn.bf16x2"
    body = (_MXFP4_SELECTORS.replace("LO", tables[0]).replace("HI", tables[1])
            + pairs.replace("pI", "p0").replace("pJ", "p1") + "shr.u32 a, a, 16;\nshr.u32 b, b, 16;\n"
            + pairs.replace("pI", "p2").replace("pJ", "p3"))
    for factor in ("$9", "$10")[:steps]:
        body += "".join(f"{fma} p{i}, p{i}, {factor}, nz;\n" for i in range(4))
    return body + _MXFP4_OUT


MXFP4_BF16_PTX = tl.constexpr(_mxfp4_ptx(False, 1))
MXFP4_BF16_2_PTX = tl.constexpr(_mxfp4_ptx(False, 2))
MXFP4_FP16_PTX = tl.constexpr(_mxfp4_ptx(True, 1))
MXFP4_FP16_2_PTX = tl.constexpr(_mxfp4_ptx(True, 2))
# The E8M0 exponents the one-factor blocks take (a scale up to 2^1: weights up to 12 in magnitude), and the largest
# fp16 takes at all (2^16: beyond it every nonzero product overflows fp16, and the factors cannot reach it).
MXFP4_ONE_FACTOR_MAX_SCALE = 128
MXFP4_FP16_MAX_SCALE = 143


# A copy Triton's passes cannot see through (not pure): the E8M0 bytes pass it before their factors reach the PTX
# block. Without it Triton's operand analysis (AccelerateMatmul's computeOrigBitWidth) follows the dot's weights back
# through the pure PTX block to the 8-bit scale load, takes the weights for an upcast of 8-bit data and keeps them in
# registers in an 8-wide K order, which costs register moves of the activations' fragments for every mma; behind
# the barrier it sees the 32-bit words and the tile goes through shared memory (STS, LDSM) as int4's does.
OPAQUE_COPY_PTX = tl.constexpr("mov.b32 $0, $1;")


@triton.jit
def _mxfp4_code(words, scale, SHIFT: tl.constexpr, DTYPE: tl.constexpr):
    """The code at SHIFT of each word (its value / 2^14) times the fp32 scale x 2^14, in DTYPE (the interpreter's
    path of `mxfp4_words_to_half`; the fp32 product is exact, so the cast rounds once)."""
    return (e2m1_bits_to_fp16((words >> SHIFT) & 15).to(tl.float32) * scale).to(DTYPE)


@triton.jit
def _per_word(group_values):
    """[G, C] -> [4 G, C]: each group's value for its 4 words (32 codes), broadcast in registers."""
    G: tl.constexpr = group_values.shape[0]
    C: tl.constexpr = group_values.shape[1]
    return tl.reshape(tl.broadcast_to(group_values[:, None, :], (G, 4, C)), (4 * G, C))


@triton.jit
def mxfp4_words_to_half(words, scale_bits, DTYPE: tl.constexpr, STEPS: tl.constexpr):
    """int32 words [4 G, C], 8 e2m1 codes each (code j in bits 4j..4j+3 is row 8 r + j: MXFP4's byte order read as
    little-endian words; 4 words a group of 32), and int32 E8M0 exponents s [G, C] -> the weights code x 2^(s - 127)
    in DTYPE (bf16 / fp16) [32 G, C], exactly: the fp32 product rounded once. STEPS: 1 where every s of the weight is
    at most MXFP4_ONE_FACTOR_MAX_SCALE, else 2 (`mxfp4_scale_factors`, per group, then broadcast to its words). On a
    GPU one PTX block per word (MXFP4_*_PTX: byte lookups by prmt, STEPS packed FMAs per two codes; sm_80+, no
    int-to-float), the exponents first through OPAQUE_COPY_PTX (see there); the interpreter decodes code by code in
    fp32 (`e2m1_bits_to_fp16`)."""
    wt = tl.trans(words)
    if INTERPRETED:
        scale = tl.trans(_per_word(((scale_bits + 14) << 23).to(tl.float32, bitcast=True)))  # 2^(s - 113)
        o0 = _mxfp4_code(wt, scale, 0, DTYPE)
        o1 = _mxfp4_code(wt, scale, 4, DTYPE)
        o2 = _mxfp4_code(wt, scale, 8, DTYPE)
        o3 = _mxfp4_code(wt, scale, 12, DTYPE)
        o4 = _mxfp4_code(wt, scale, 16, DTYPE)
        o5 = _mxfp4_code(wt, scale, 20, DTYPE)
        o6 = _mxfp4_code(wt, scale, 24, DTYPE)
        o7 = _mxfp4_code(wt, scale, 28, DTYPE)
    else:
        s = tl.inline_asm_elementwise(OPAQUE_COPY_PTX, "=r,r", [scale_bits], dtype=tl.int32, is_pure=False, pack=1)
        f1, f2 = mxfp4_scale_factors(s, DTYPE, STEPS)
        f1 = tl.trans(_per_word(f1))
        if STEPS == 1:
            if DTYPE == tl.float16:
                o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                    MXFP4_FP16_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [wt, f1], dtype=(tl.float16,) * 8, is_pure=True,
                    pack=1)
            else:
                o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                    MXFP4_BF16_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [wt, f1], dtype=(tl.bfloat16,) * 8, is_pure=True,
                    pack=1)
        elif DTYPE == tl.float16:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                MXFP4_FP16_2_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [wt, f1, tl.trans(_per_word(f2))],
                dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            o0, o1, o2, o3, o4, o5, o6, o7 = tl.inline_asm_elementwise(
                MXFP4_BF16_2_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r", [wt, f1, tl.trans(_per_word(f2))],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    return _word_rows(o0, o1, o2, o3, o4, o5, o6, o7)


@triton.jit
def mxfp4_scale_factors(s, DTYPE: tl.constexpr, STEPS: tl.constexpr):
    """E8M0 exponents s (int32) -> (f1, f2): int32 pairs of DTYPE powers of two (the same in both halves) whose
    product with the decoded code (value x 2^-126 in bf16, x 2^-14 in fp16) is value x 2^(s - 127), each
    multiply exact but the last, which rounds once. STEPS = 1 (s <= 128): f1 alone, bf16 2^(s - 1), fp16
    2^(s - 113) (s below 99 taken as 99: every product of such a scale, at most 6 x 2^-28, rounds to zero in fp16
    either way). STEPS = 2 (any s; fp16 up to MXFP4_FP16_MAX_SCALE): bf16 2^126 then 2^(s - 127) (0x0040, the
    subnormal 2^-127, for s = 0); fp16 2^15 for s > 128 (else 1) then the rest of 2^(s - 113)."""
    if DTYPE == tl.float16:
        big = (s > 128).to(tl.int32) * (15 * (STEPS - 1))  # 2^15 first where the rest would not fit fp16
        f2 = (tl.maximum(s, 99) - 98 - big) * 0x04000400  # exponent field of 2^(s - 113 - big), >= 1, << 10
        f1 = (15 + big) * 0x04000400
        if STEPS == 1:
            f1 = f2
    elif STEPS == 1:
        f1 = s * 0x800080 + 0x3F003F00  # (s + 126) << 7 in both halves
        f2 = f1
    else:
        f1 = tl.full(s.shape, 0x7E807E80, tl.int32)
        f2 = tl.maximum(s << 7, 0x40) * 0x10001
    return f1, f2


# PTX of `e4m3_words_to_halves` on word $4 (e4m3 bytes b0..b3, b0 lowest): each code's value / 2^8 in fp16 or bf16,
# two consecutive rows a register, no conversion instruction. Per two codes one prmt puts b(2i) and b(2i + 1) in the
# low bytes of the two halves and their sign bits, replicated (the prmt's sign mode: selector bit 3), in the high
# bytes; one shift left moves each code's 4 exponent and 3 mantissa bits to the low exponent and top mantissa bits of
# the half and a replicated sign bit to bit 15, and one and keeps just those. fp16 (shift by 7): e4m3's value x 2^-8,
# subnormals too, as `e4m3_bits_to_fp16`. bf16 (shift by 4): the value x 2^-120, e4m3's subnormals bf16 subnormals,
# then one packed bf16 FMA by 2^112 (0x7780; with -0, which keeps the sign of zero) gives the value x 2^-8, exactly
# (bf16 FMAs keep subnormals).
_E4M3_PAIR_PTX = """prmt.b32 p, $4, 0, SELECTOR;
shl.b32 p, p, SHIFT;
and.b32 pI, p, MASK;
"""
_E4M3_WORD_PTX = """{
.reg .b32 p, p0, p1, b, z;
""" + _E4M3_PAIR_PTX.replace("SELECTOR", "0x9180").replace("pI", "p0") + _E4M3_PAIR_PTX.replace(
    "SELECTOR", "0xB3A2").replace("pI", "p1") + """BIAS
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
}"""
E4M3_FP16_PTX = tl.constexpr(_E4M3_WORD_PTX.replace("SHIFT", "7").replace("MASK", "0xBF80BF80").replace("BIAS\n", ""))
E4M3_BF16_PTX = tl.constexpr(_E4M3_WORD_PTX.replace("SHIFT", "4").replace("MASK", "0x87F087F0").replace("BIAS", """mov.b32 b, 0x77807780;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 p0, p0, b, z;
fma.rn.bf16x2 p1, p1, b, z;"""))


@triton.jit
def e4m3_words_to_halves(words, DTYPE: tl.constexpr):
    """int32 words [R, C] of float8_e4m3fn bytes packed along K (byte i of word r is row 4 r + i) -> each weight's
    value / 2^8 in DTYPE (fp16 / bf16) [4 R, C], exactly, as `e4m3_bits_to_fp16` (multiply by E4M3_TO_FP16_BIAS on
    the dot's fp32 result). On a GPU one PTX block per word (E4M3_FP16_PTX / E4M3_BF16_PTX: per two codes one prmt,
    one shift and one and, in bf16 one packed FMA); the interpreter decodes byte by byte in fp16 (it runs
    this path in fp16 only, `fp8_gemm.fp8_word_decode`). Rows as `int8_words_to_halves` places them."""
    wt = tl.trans(words)
    if INTERPRETED:
        o0 = e4m3_bits_to_fp16(wt & 255)
        o1 = e4m3_bits_to_fp16((wt >> 8) & 255)
        o2 = e4m3_bits_to_fp16((wt >> 16) & 255)
        o3 = e4m3_bits_to_fp16((wt >> 24) & 255)
    elif DTYPE == tl.float16:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            E4M3_FP16_PTX, "=h,=h,=h,=h,r", [wt], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            E4M3_BF16_PTX, "=h,=h,=h,=h,r", [wt], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
    return tl.trans(tl.interleave(tl.interleave(o0, o2), tl.interleave(o1, o3)))


@triton.jit
def e4m3_bits_to_fp16(u):
    """uint8 e4m3 bit patterns -> fp16 value / 2^8, exactly (also for subnormals; multiply by
    E4M3_TO_FP16_BIAS, in fp32, for the value itself).

    Moving the 7 exponent+mantissa bits up by 7 puts e4m3's 4-bit exponent and 3-bit mantissa
    into fp16's fields; fp16's exponent bias is 8 larger, so the result is the value * 2^-8.
    """
    u = u.to(tl.uint16)
    return (((u & 0x7F) << 7) | ((u & 0x80) << 8)).to(tl.float16, bitcast=True)


@triton.jit
def e2m1_bits_to_fp16(code):
    """MXFP4 element codes [...] int32 (0..15: sign bit 3, exponent bits 1-2, mantissa bit 0) -> fp16
    value / 2^14, with integer ops only (no table, no fp4 type: any GPU). The exponent and mantissa bits
    land in fp16's lowest exponent bits and top mantissa bit, so fp16 reads 2^(e - 15) (1 + m/2), or
    m 2^-15 for e = 0 (subnormal), i.e. the e2m1 value 2^(e - 1) (1 + m/2) / m/2 times 2^-14, exactly."""
    return (((code & 7) << 9) | ((code & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def round_to_e4m3(v):
    """Round fp32 v (|v| <= 448) to the nearest e4m3 value, ties to even, still as fp32.

    The cast that follows is then exact everywhere; Triton's interpreter rounds wrongly when
    the mantissa carries into the exponent (124.3 -> 64), the GPU's cvt.rn would agree.
    Normals keep 3 of fp32's 23 mantissa bits (add half an ulp minus one plus the kept lsb,
    truncate); below 2^-6 e4m3 is subnormal with a fixed step 2^-9, and adding and removing
    1.5 * 2^14 (whose fp32 ulp is 2^-9) rounds to that step.
    """
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def e4m3_bits_from_fp32(v):
    """fp32 v (|v| <= 448) -> uint8 e4m3 bit patterns of v rounded to nearest (ties to even), with
    integer ops only: the inverse of `e4m3_bits_to_fp16`, for GPUs without Triton's e4m3 type.

    round_to_e4m3 makes v an e4m3 value; v * 2^-8 is then an fp16 value (normal or subnormal) whose
    exponent and top 3 mantissa bits are e4m3's fields, moved down by 7 (sign from bit 15)."""
    h = (round_to_e4m3(v) * 0.00390625).to(tl.float16)  # x 2^-8, exact
    h = h.to(tl.uint16, bitcast=True)
    return (((h >> 7) & 0x7F) | ((h >> 8) & 0x80)).to(tl.uint8)


@triton.jit
def ieee_dot(a, b, acc):
    """tl.dot(a, b, acc); fp32 operands are multiplied in IEEE fp32. Triton's default for them is
    tf32 on sm_80+ (10-bit mantissas: ~1e-3 relative error), and fp32 is the exact check path."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def activation_scale(x, static_scale_ptr, STATIC: tl.constexpr, Q_MAX: tl.constexpr, EPS: tl.constexpr):
    """The scale quantizing the fp32 activations x [BLOCK] (masked lanes 0): the static one at static_scale_ptr,
    or absmax / Q_MAX with absmax floored at EPS (an all-zero row gets a finite scale). div_rn: IEEE division,
    so the GPU rounds exactly like the torch references (plain `/` is approximate on NVIDIA)."""
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        absmax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS)
        scale = tl.math.div_rn(absmax, tl.zeros_like(absmax) + Q_MAX)
    return scale


@triton.jit
def divide_by_scale(x, scale):
    """fp32 x / scale, rounded as IEEE division (div_rn) rounds it, for a positive scale shared by many x (a scalar, or
    [R, 1] against x [R, C]): the activation quantizers' division. One IEEE reciprocal r = 1 / scale per scale, then per
    x q = x r and two corrections q + (x - q scale) r by FMA (the remainder is exact), the second correctly rounded
    (Markstein's theorem: r within half an ulp of 1 / scale, q within one ulp): five FMAs and a sign copy per x, where
    div_rn repeats the reciprocal and adds a range check and a slow-path branch. Exact for finite x where x and the
    quotient lie between 2^-100 and 2^126 in magnitude (the remainders stay normal); outside, the quantizers saturate
    anyway, or both quotients are below 2^-40 (scales >= 2^-42): code 0 either way. tests/kernels/test_dequant_bits.py
    compares it bit for bit with torch's division. The OR of x's sign bit keeps -0 / scale = -0 (the corrections add
    +0)."""
    r = tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale)
    q = x * r
    q = tl.fma(tl.fma(-q, scale, x), r, q)
    q = tl.fma(tl.fma(-q, scale, x), r, q)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def rows_absmax(x_ptrs, mask_m, k_lo, k_hi, BLOCK_K: tl.constexpr):
    """max |x| over columns [k_lo, k_hi) of each row, fp32 [BLOCK_M]: x_ptrs [BLOCK_M, BLOCK_K] point at column 0
    of the rows (masked rows give 0). The GEMMs that quantize their activations in the kernel (fp8_gemm, int8_gemm
    at decode M) take a row's or a group's scale from it, read in BLOCK_K steps."""
    offs_k = tl.arange(0, BLOCK_K)
    absmax = tl.zeros(mask_m.shape, tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & (offs_k < k_hi - k0)[None, :], other=0.0)
        absmax = tl.maximum(absmax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    return absmax


@triton.jit
def broadcast_rows(t, ROWS: tl.constexpr):
    """t [R, C] -> [ROWS, C] (R divides ROWS), row i = t[i % R]. A decode GEMM that quantizes its activations
    itself (fp8_gemm, int8_gemm) quantizes only the M bucket's R rows (`quant_rows`), not the dot's padding rows,
    and copies them up to BLOCK_M here: with M <= R < BLOCK_M the copies meet masked output rows only. On a GPU the
    rows pass an identity asm marked impure first: without it Triton computes the quantization in the dot operand's
    layout, where each warp holds every row (32 quantizations a thread per K tile at M = 1, not one)."""
    R: tl.constexpr = t.shape[0]
    if R == ROWS:
        return t
    if not INTERPRETED:
        t = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [t], dtype=t.dtype, is_pure=False,
                                      pack=32 // t.dtype.primitive_bitwidth)
    return tl.reshape(tl.broadcast_to(t[None, :, :], (ROWS // R, R, t.shape[1])), (ROWS, t.shape[1]))


@triton.jit
def gemm_tile(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """What program (program_id(0), program_id(1)) computes: rows [BLOCK_M] (int64: row x stride reaches
    2^31 elements for M * K or M * N >= 2^31, long prefills), offs_n [BLOCK_N], offs_k [BLOCK_K], their masks,
    and [k_start, k_end), its K slice.

    Tiles in grouped order: GROUP_M row-blocks share each weight column-block while it is in L2. The K slice
    is whole BLOCK_K tiles (a tile never straddles a scale block); all of K when SPLIT_K is 1."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    first_m = (pid // (GROUP_M * grid_n)) * GROUP_M
    group_rows = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % group_rows
    pid_n = (pid % (GROUP_M * grid_n)) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = 0
    k_end = K
    if SPLIT_K > 1:
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_start = tl.program_id(1) * k_per_split
        k_end = min(k_start + k_per_split, K)
    return offs_m.to(tl.int64), offs_n, tl.arange(0, BLOCK_K), offs_m < M, offs_n < N, k_start, k_end


@triton.jit
def k_tile_mask(offs, k_left, EVEN_K: tl.constexpr):
    """offs < k_left: the mask of a K tile's first k_left elements (offs = tl.arange over the tile). With EVEN_K (K a
    multiple of BLOCK_K, so no tile of any K slice is partial) every element, as a constant: the loads' predicates
    are then loop-invariant, not recomputed per K tile."""
    if EVEN_K:
        mask = offs < offs.shape[0]
    else:
        mask = offs < k_left
    return mask


@triton.jit
def activation_rows(rows, mask_m, M, QUANTIZE_A: tl.constexpr, QUANT_ROWS: tl.constexpr):
    """The rows of x (int64) a `gemm_tile` program reads, and their mask. A GEMM that quantizes its activations itself
    (QUANTIZE_A) for fewer rows than BLOCK_M (M <= QUANT_ROWS < BLOCK_M: one row block) reads the first QUANT_ROWS
    (`quant_rows`), which `broadcast_rows` copies up to BLOCK_M after quantizing; otherwise the tile's own rows."""
    if QUANTIZE_A and QUANT_ROWS < rows.shape[0]:
        a_rows = tl.arange(0, QUANT_ROWS).to(tl.int64)
        mask_a = a_rows < M
    else:
        a_rows, mask_a = rows, mask_m
    return a_rows, mask_a


@triton.jit
def store_output(y_ptr, out, rows, offs_n, mask_m, N, stride_ym, SILU_MUL: tl.constexpr):
    """Store the fp32 tile out [BLOCK_M, BLOCK_N] (columns offs_n of the GEMM's N) at rows (int64) of y, in y's
    dtype. With SILU_MUL the GEMM's columns are (gate, up) pairs, 2i and 2i + 1 (the gate_up weight's rows
    interleaved at load, `kernels.linear.prepare_gate_up`), and column i of y [M, N / 2] gets silu(gate) * up in
    fp32: SwiGLU's activation in the gate_up GEMM's epilogue, no launch of its own, no [M, N] round trip."""
    if SILU_MUL:
        gate, up = tl.split(tl.reshape(out, (out.shape[0], out.shape[1] // 2, 2)))
        cols, _ = tl.split(tl.reshape(offs_n // 2, (offs_n.shape[0] // 2, 2)))
        mask = mask_m[:, None] & (cols < N // 2)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :],
                 (gate / (1.0 + tl.exp(-gate)) * up).to(y_ptr.dtype.element_ty), mask=mask)
    else:
        mask = mask_m[:, None] & (offs_n < N)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rms_norm_tile(y_ptr, out, rows, offs_n, mask_m, M, N, res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr,
                      row_block, tile_n, eps):
    """A row-parallel linear's epilogue that adds the residual and normalizes (a pre-norm layer's o_proj then its
    post-attention RMSNorm, in the GEMM's launch): y = (out rounded to y's dtype) + residual, rounded (torch's
    addition of the two), and h = y / sqrt(mean(y^2) + eps) * w over each whole row, in fp32, as
    norm_rope.add_rms_norm computes them. y, residual, h: contiguous [M, N].

    A row's mean needs every column tile of it: each tile stores y and its rows' partial sum of y^2 in plane tile_n
    of sumsq [cdiv(N, BLOCK_N), M] and counts itself in row_arrivals[row_block] (int32, 0 between launches, as
    `reduce_split_k`'s counts); the last tile of the row block adds the planes in tile order (deterministic) and
    writes h over the whole rows, reading y back past L1 (.cg), then sets the count back to 0."""
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    ptrs = rows[:, None] * N + offs_n[None, :]
    # (in fp32, then rounded: torch's 16-bit addition; the interpreter adds bf16 as raw bits)
    y = out.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(res_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + ptrs, y, mask=mask)
    y = y.to(tl.float32)
    tl.store(sumsq_ptr + tile_n * M + rows, tl.sum(y * y, axis=1), mask=mask_m)
    tl.debug_barrier()
    arrived = tl.atomic_add(row_arrivals_ptr + row_block, 1, sem="acq_rel", scope="gpu")
    tiles = tl.cdiv(N, out.shape[1])
    if arrived == tiles - 1:
        sumsq = tl.zeros_like(tl.sum(y, axis=1))
        plane = sumsq_ptr + rows  # stepped by M: one register fewer than indexing t * M + rows (int64)
        for _ in range(tiles):
            sumsq += tl.load(plane, mask=mask_m, other=0.0, cache_modifier=".cg")
            plane += M
        rstd = 1.0 / tl.sqrt(sumsq / N + eps)
        cols = tl.arange(0, out.shape[1])
        for n0 in range(0, N, out.shape[1]):
            mask_c = mask_m[:, None] & (n0 + cols < N)[None, :]
            ptrs = rows[:, None] * N + (n0 + cols)[None, :]
            row = tl.load(y_ptr + ptrs, mask=mask_c, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(norm_w_ptr + n0 + cols, mask=n0 + cols < N, other=0.0).to(tl.float32)
            tl.store(h_ptr + ptrs, (row * rstd[:, None] * w[None, :]).to(h_ptr.dtype.element_ty), mask=mask_c)
        tl.atomic_xchg(row_arrivals_ptr + row_block, 0)


@triton.jit
def reduce_split_k(acc, partials_ptr, arrivals_ptr, tile, k_slice, rows, offs_n, mask_m, mask_n, M, N,
                   SPLIT_K: tl.constexpr):
    """The split-K sum inside the GEMM's own launch (no second and third launch to add and cast): returns
    (the tile's fp32 sum, whether this program holds it); the caller stores it when it does (`store_output`,
    `add_rms_norm_tile`).

    K slice k_slice of output tile `tile` stores its fp32 tile acc in plane k_slice of partials [SPLIT_K, M, N]
    and counts itself in arrivals[tile] (int32, one per output tile, 0 between launches). The slice that
    arrives last adds the planes in slice order, so y is the same sum whatever order the slices ran in
    (deterministic, unlike fp32 atomics), and sets the count back to 0 for the next launch. The acq_rel atomic
    after the block's barrier makes every slice's stores visible to the last one, whose loads bypass the
    (incoherent) L1: .cg."""
    mask = mask_m[:, None] & mask_n[None, :]
    plane = rows[:, None] * N + offs_n[None, :]
    tl.store(partials_ptr + k_slice.to(tl.int64) * M * N + plane, acc, mask=mask)
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    total = tl.zeros_like(acc)
    if last:
        ptrs = partials_ptr + plane
        for _ in range(SPLIT_K):
            total += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            ptrs += M * N
        tl.atomic_xchg(arrivals_ptr + tile, 0)
    return total, last


@triton.jit
def sum_expert_slots(rows_ptr, out_ptr, ids_ptr, arrivals_ptr, tile_n, offs_n, N, T, top_k, arriving,
                     BLOCK_T: tl.constexpr):
    """The MoE down GEMM's epilogue after it stored its tile of (token, slot) rows (weighted, in out's dtype) in
    rows [T * top_k, N]: out [T, N] = each token's top_k rows summed in fp32 in slot order, in the same launch (no
    zero fill, sum and cast launches after it).

    A token's slots lie in different row blocks (different experts), so the row blocks of column tile tile_n count
    themselves in arrivals[tile_n] (int32, 0 between launches, as `reduce_split_k`'s); the one that arrives last
    (the arriving-th) sums every token of the column tile, BLOCK_T tokens at a time, reading the rows past L1 (.cg),
    and sets the count back to 0. The order is fixed whatever order the blocks ran in (deterministic, unlike fp32
    atomics into out) and a token's sum does not depend on the other tokens (batch-invariant). Slots whose id is
    -1 (another rank's expert: no block computed them) add nothing; a token with none gets a zero row, so every
    row of out is written."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + tile_n, 1, sem="acq_rel", scope="gpu")
    if arrived == arriving - 1:
        n_in = offs_n < N
        for t0 in range(0, T, BLOCK_T):
            tokens = t0 + tl.arange(0, BLOCK_T)
            t_in = tokens < T
            total = tl.zeros((BLOCK_T, offs_n.shape[0]), tl.float32)
            for j in range(top_k):
                slots = tokens.to(tl.int64) * top_k + j
                held = tl.load(ids_ptr + slots, mask=t_in, other=-1) >= 0
                total += tl.load(rows_ptr + slots[:, None] * N + offs_n[None, :], mask=held[:, None] & n_in[None, :],
                                 other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + tokens.to(tl.int64)[:, None] * N + offs_n[None, :],
                     total.to(out_ptr.dtype.element_ty), mask=t_in[:, None] & n_in[None, :])
        tl.atomic_xchg(arrivals_ptr + tile_n, 0)


def slot_sum_args(slot_sum: tuple | None, top_k: int) -> dict:
    """The arguments of an expert GEMM kernel's slot sum (`sum_expert_slots`) from slot_sum = (sum [T, N], topk_ids
    [T, top_k], arrivals: one int32 zero per column tile, `arrival_counts`); None (gate_up): none."""
    if slot_sum is None:
        return {}
    out, topk_ids, arrivals = slot_sum
    return dict(sum_ptr=out, topk_ids_ptr=topk_ids, arrivals_ptr=arrivals, top_k=top_k, SUM_SLOTS=True)


@triton.jit
def store_gemm_tile(y_ptr, out, bias_ptr, partials_ptr, arrivals_ptr, rows, offs_n, mask_m, mask_n, stride_ym, M, N,
                    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr,
                    res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr, eps, ADD_NORM: tl.constexpr):
    """Store the fp32 tile out [BLOCK_M, BLOCK_N] at rows (int64) x offs_n of y, adding the bias in the
    first K slice only; with SPLIT_K > 1 through `reduce_split_k` (tile program_id(0), slice program_id(1));
    SILU_MUL: SwiGLU's activation of (gate, up) column pairs (`store_output`); ADD_NORM: y = the tile + residual
    and h its RMSNorm (`add_rms_norm_tile`; GROUP_M 1, so tile program_id(0) is row block x column tiles + column
    tile)."""
    if HAS_BIAS:
        first_slice = (tl.zeros(offs_n.shape, tl.int32) + tl.program_id(1)) == 0
        out += tl.load(bias_ptr + offs_n, mask=mask_n & first_slice, other=0.0).to(tl.float32)[None, :]
    last = True
    if SPLIT_K > 1:
        out, last = reduce_split_k(out, partials_ptr, arrivals_ptr, tl.program_id(0), tl.program_id(1), rows,
                                   offs_n, mask_m, mask_n, M, N, SPLIT_K)
    if last:
        if ADD_NORM:
            tiles_n = tl.cdiv(N, out.shape[1])
            add_rms_norm_tile(y_ptr, out, rows, offs_n, mask_m, M, N, res_ptr, norm_w_ptr, h_ptr, sumsq_ptr,
                              row_arrivals_ptr, tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n, eps)
        else:
            store_output(y_ptr, out, rows, offs_n, mask_m, N, stride_ym, SILU_MUL)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate), in place of SiLU-and-mul:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=limit).
    fused_moe's Triton epilogue computes the same in fp32; `apply` is the torch form (CPU, references)."""
    alpha: float = 1.702
    limit: float = 7.0

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * g * torch.sigmoid(self.alpha * g)


def silu_mul_pairs(y: torch.Tensor) -> torch.Tensor:
    """Plain torch form of the SwiGLU epilogue (`store_output`): y [..., 2I] of (gate, up) column pairs ->
    silu(gate) * up [..., I], in fp32, rounded once to y's dtype (the GEMMs' reference and CPU paths)."""
    pairs = y.float().unflatten(-1, (-1, 2))
    return (torch.nn.functional.silu(pairs[..., 0]) * pairs[..., 1]).to(y.dtype)


def on_gpu(x: torch.Tensor) -> bool:
    """True where the kernel is compiled for a GPU: CUDA tensors, and meta tensors (tune --aot)."""
    return x.device.type in ("cuda", "meta")


def upcast_dot(x: torch.Tensor) -> bool:
    """The UPCAST_DOT flag of the GEMM kernels: fp32 activations run an exact (ieee, not tf32) fp32
    dot; so do bf16 ones under the interpreter, which multiplies bf16 tl.dot operands as raw bits
    (triton-lang/triton#11584, unsupported upstream): there the dot runs in fp32 on the same
    bf16-rounded values."""
    return x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and not on_gpu(x))


def int4_word_dequant(x: torch.Tensor, w, cc: int | None = None) -> bool:
    """The WORD_DEQUANT flag of the int4 GEMMs (int4_gemm, moe), decided once per plan: an Int4Weight `w` of 4-bit
    codes without a code table, with scales in x's half dtype, goes through `int4_words_minus_zero` (inline PTX on
    a GPU from sm_80; fp16 only under the interpreter, which misreads bitcast bf16); everything else through the
    plain-Triton unpack (`unpack_int_tile`, `dequantize_int_tile`). sm_75 keeps the plain path: its dots run on
    FMA, where the word path's tiles spill. cc: the target of meta tensors (AOT; None: sm_80+); CUDA tensors'
    own device decides."""
    return w.bits == 4 and w.code is None and w.scales.dtype == x.dtype and half_bit_tricks(x, cc)


def int8_word_dequant(x: torch.Tensor, w, cc: int | None = None) -> bool:
    """int4_gemm's WORD_DEQUANT flag for 8-bit codes (`int8_words_minus_zero`), under the conditions of
    `int4_word_dequant`."""
    return w.bits == 8 and w.code is None and w.scales.dtype == x.dtype and half_bit_tricks(x, cc)


def half_bit_tricks(x: torch.Tensor, cc: int | None = None) -> bool:
    """Whether the packed-word paths (inline PTX over half pairs) run for activations x: fp16 / bf16 on a GPU from
    sm_80 (cc: the target of meta tensors, None: sm_80+; CUDA tensors' own device decides), fp16 only under the
    interpreter (which misreads bitcast bf16)."""
    if x.is_cuda:
        cc = compute_capability(x.device)
    return (cc is None or cc >= 80) and x.dtype in ((torch.float16, torch.bfloat16) if on_gpu(x) else (torch.float16,))


def mxfp4_word_decode(x: torch.Tensor, cc: int | None = None) -> bool:
    """Whether MXFP4 experts for activations like x decode by `mxfp4_words_to_half` (decided once per plan): bf16 /
    fp16 activations on a GPU from sm_80 (its packed half FMAs) and under the interpreter; sm_75 keeps the plain decode
    (`e2m1_bits_to_fp16`, the scale in fp32). cc: the target of meta tensors (AOT; None: sm_80+); CUDA tensors' own
    device decides."""
    if x.is_cuda:
        cc = compute_capability(x.device)
    return x.dtype in (torch.bfloat16, torch.float16) and (cc is None or cc >= 80)


def compute_capability(device: torch.device) -> int | None:
    """10 x major + minor of a CUDA device (90 for sm_90); None elsewhere (the interpreter's small tiles)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def gpu_compute_dtypes(cc: int) -> tuple[torch.dtype, ...]:
    """The model dtypes the Triton kernels run in on sm_`cc`, the default first: bf16 and fp16 from
    sm_80 (Ampere); fp16 only below (T4, V100: no bf16 arithmetic, torch would emulate it). Never fp32:
    its tiles overflow shared memory (attention, fp8 and int4 prefill tiles on sm_89/90) and its GEMM
    dots run without tensor cores. The launch configs are AOT-checked for exactly these (tests/aot/test_fit.py)."""
    return (torch.bfloat16, torch.float16) if cc >= 80 else (torch.float16,)


@functools.cache
def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether the kernels can use Triton's float8e4nv type (e4m3 loads and tl.dot) on `device`.

    CUDA: from sm_89 (Ada, Hopper); below it the fp8 kernels decode e4m3 bytes with integer ops
    (`e4m3_bits_to_fp16`) and fp8_gemm runs weight-only; said once in the log. CPU: True, Triton's
    interpreter emulates e4m3 (the CPU backend without it runs no fp8 kernel at all).
    """
    if device.type != "cuda":
        return True
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= (8, 9):
        return True
    log.warning("%s is sm_%d%d, below sm_89 (no fp8 tensor cores): fp8 weights are decoded to fp16/bf16 in "
                "the kernels and fp8_gemm runs weight-only (activations unquantized)",
                torch.cuda.get_device_name(device), major, minor)
    return False


C = TypeVar("C")
INVARIANT_ROWS = 64  # the row count every launch config is chosen for in the batch-invariant mode


def config_rows(M: int) -> int:
    """The row count a GEMM's launch config is chosen for: M, or in the batch-invariant mode INVARIANT_ROWS whatever
    M (one tile shape, no split-K: each row's sums in one order whatever else is in the batch, as vLLM's and SGLang's
    deterministic modes fix their GEMM configs; docs/batch_invariance.md)."""
    return INVARIANT_ROWS if batch_invariant() else M


def tuned_or_default(kernel: str, bucket: str, default: C) -> C:
    """The config tuned for `bucket` on this GPU (configs/<kernel>/<gpu>.json, written by
    `python -m tritonq.tune`) laid over `default`, or `default` when there is none."""
    tuned = lookup(kernel, bucket)
    return dataclasses.replace(default, **tuned) if tuned is not None else default


def _pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def check_launch_config(kernel: str, config, config_type: type) -> None:
    """TypeError unless config is a `config_type`; ValueError unless it is launchable: BLOCK_* fields
    powers of two >= 16 (tl.dot's smallest tile), other upper-case fields (SPLIT_K, GROUP_M,
    NUM_SPLITS) ints >= 1, num_warps a power of two <= 32, num_stages an int >= 1. `kernel` names
    the caller in the message."""
    if not isinstance(config, config_type):
        raise TypeError(f"{kernel}: config must be a {config_type.__name__}, got {type(config).__name__}")
    for field in dataclasses.fields(config):
        name, value = field.name, getattr(config, field.name)
        if name.startswith("BLOCK_") and (not _pow2(value) or value < 16):
            raise ValueError(f"{kernel}: config.{name} = {value!r}, expected a power of two >= 16 "
                             "(tl.dot's smallest tile), e.g. 64")
        if name.isupper() and not name.startswith("BLOCK_") and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{kernel}: config.{name} = {value!r}, expected an int >= 1 (1: no split)")
    if not _pow2(config.num_warps) or config.num_warps > 32:
        raise ValueError(f"{kernel}: config.num_warps = {config.num_warps!r}, expected a power of two in [1, 32]")
    if not isinstance(config.num_stages, int) or config.num_stages < 1:
        raise ValueError(f"{kernel}: config.num_stages = {config.num_stages!r}, expected an int >= 1")


@dataclass(frozen=True)
class GemmConfig:
    """Launch config of a tiled GEMM kernel with grouped ordering and split-K (fp8_gemm and int8_gemm subclass
    it, one type per kernel so that `check_launch_config` tells them apart)."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int = 128
    GROUP_M: int = 8
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the M bucket of the GEMM plans. Plain int arithmetic:
    triton.next_power_of_2 is a constexpr function, ~10 us a call on the host."""
    return 1 << max(0, n - 1).bit_length()


def gemm_config_bucket(M: int, N: int, K: int) -> str:
    """Key of a tuned GEMM config: M rounded up to a power of two (capped at 4096), exact N and K."""
    return f"M{min(triton.next_power_of_2(M), 4096)}_N{N}_K{K}"


# Up to this many rows fp8_gemm and int8_gemm quantize their activations inside the GEMM (each program reads the
# rows' absmax over all of K itself: x is tiny at decode), one launch; above it a quantization kernel runs first.
QUANTIZE_IN_GEMM_MAX_M = 16


def quant_rows(M: int, block_m: int) -> int:
    """QUANT_ROWS of a GEMM that quantizes its activations in the kernel: the rows it quantizes per K tile, the M
    bucket (M rounded up to a power of two) up to the tile's block_m (`broadcast_rows`)."""
    return min(next_pow2(M), block_m)


def decode_split_k(N: int, K: int, block_k: int, block_n: int = 64) -> int:
    """SPLIT_K of a decode-sized GEMM (BLOCK_N block_n): about 256 programs (~2 waves) stream the weight, with at
    least 4 K tiles of block_k per slice so that each slice still pipelines its loads."""
    return max(1, min(triton.cdiv(K, block_k) // 4, 256 // triton.cdiv(N, block_n)))


def check_gemm_weight(kernel: str, w, weight_type: type, dtype: torch.dtype, fix: str = "") -> None:
    """A ValueError naming kernel unless w is a weight_type whose .weight is a 2-D dtype [N, K] tensor."""
    if not isinstance(w, weight_type):
        raise ValueError(f"{kernel} expects a {weight_type.__name__}, got {type(w).__name__}")
    if w.weight.dtype != dtype or w.weight.dim() != 2:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"{weight_type.__name__}.weight must be a 2-D {name} [N, K] tensor, got {w.weight.dtype} "
                         f"{tuple(w.weight.shape)}{fix}")


def check_gemm_activations(kernel: str, x: torch.Tensor, N: int, K: int, device: torch.device) -> None:
    """A ValueError naming kernel unless x [..., K] is fp16/bf16/fp32 on the weight's device."""
    if x.shape[-1] != K:
        raise ValueError(f"{kernel}: x has K={x.shape[-1]} columns but the weight is [N={N}, K={K}]; "
                         "pass activations whose last dim equals the weight's input size")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{kernel}: x dtype {x.dtype} is not supported; use float16, bfloat16 or float32")
    if x.device != device:
        raise ValueError(f"{kernel}: x is on {x.device} but the weight is on {device}; move one of them")


def gemm_grid(M: int, N: int, config: GemmConfig) -> tuple[int, int]:
    """One program per (output tile, K slice): (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), SPLIT_K)."""
    return triton.cdiv(M, config.BLOCK_M) * triton.cdiv(N, config.BLOCK_N), config.SPLIT_K


def gemm_output(M: int, N: int, config, out_dtype: torch.dtype, device, arrivals: torch.Tensor | None = None,
                silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GEMM launch's buffers (y, partials, arrivals): y [M, N] in out_dtype ([M, N / 2] with the SwiGLU epilogue,
    silu_mul); with SPLIT_K > 1 the fp32
    [SPLIT_K, M, N] partials that `reduce_split_k` adds up in the launch and the arrival counts (`arrivals`
    when given, a plan's, else fresh zeros); with SPLIT_K 1 both stand in as y (unused)."""
    y = torch.empty((M, N // 2 if silu_mul else N), dtype=out_dtype, device=device)
    if config.SPLIT_K == 1:
        return y, y, y
    partials = torch.empty((config.SPLIT_K, M, N), dtype=torch.float32, device=device)
    return y, partials, arrivals if arrivals is not None else split_k_arrivals(M, N, config, device)


def split_k_arrivals(max_m: int, N: int, config, device: torch.device) -> torch.Tensor | None:
    """`reduce_split_k`'s arrival counts for up to max_m rows: one int32 zero per output tile of `config`
    (None without split-K), made before any CUDA graph capture: inside one the zeroing would be a node
    of the graph, not done now, and the counts garbage until a replay."""
    if config.SPLIT_K == 1:
        return None
    return arrival_counts(triton.cdiv(max_m, config.BLOCK_M) * triton.cdiv(N, config.BLOCK_N), device)


def arrival_counts(n: int, device: torch.device) -> torch.Tensor:
    """n int32 zeros: the arrival counts of a launch's last-program-finishes pattern (`reduce_split_k`,
    `add_rms_norm_tile`), which the last program sets back to 0. Made before any CUDA graph capture: inside one
    the zeroing would be a node of the graph, not done now, and the counts garbage until a replay."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a GEMM met a new shape during CUDA graph capture: run each captured shape once before "
                           "capturing it (the engine's warm-up does)")
    return torch.zeros(n, dtype=torch.int32, device=device)


@dataclass
class Launch:
    """One kernel launch: `args` holds every parameter of `kernel` by name (tensors, ints, floats and
    constexpr values), `grid` the program grid. Built by the builder in the kernel's file; called by
    its launcher, compiled by `kernels.aot.compile_launch` for tune --aot.

    Calling it launches on the device of its tensors: Triton takes the device (and stream) of a launch from
    torch's *current* CUDA device, which is cuda:0 in every thread that never set it, so a model on
    cuda:1 would run its kernels in device 0's context with device 1's pointers. Every Triton launch of
    tritonq goes through here (tests/api/test_device_context.py holds that)."""
    kernel: Any
    grid: tuple[int, ...]
    args: dict
    num_warps: int
    num_stages: int

    def __post_init__(self):
        device = next((v.device for v in self.args.values() if isinstance(v, torch.Tensor)), None)
        # the CUDA device to enter; None: the interpreter (CPU tensors) and meta tensors have no context
        self.cuda_device = device if device is not None and device.type == "cuda" else None

    def __call__(self, grid: tuple[int, ...] | None = None, **bound) -> None:
        """Launch with `args`; a launch built once and run per call (a `GemmPlan`) passes the grid and the
        arguments that change per call (activations, output, M) here, over the ones it holds."""
        with torch.cuda.device(self.cuda_device) if self.cuda_device is not None else contextlib.nullcontext():
            self.kernel[grid or self.grid](**(self.args | bound if bound else self.args),
                                           num_warps=self.num_warps, num_stages=self.num_stages)


class WeightGemm:
    """Base of the per-weight GEMM objects (Int4Gemm, FP8Gemm, Int8Gemm): the weight held weakly, so the caches
    of bare calls (weight -> its GEMM object, weak keys) let the weight go; a Linear holds its weight itself.
    A subclass sets N, K, device, silu_mul and plans (its GemmPlans by key)."""

    HAS_ADD_NORM_EPILOGUE = True  # whether `add_rms_norm` exists: the kernel has the residual + RMSNorm epilogue

    def __init__(self, w):
        self._weight = weakref.ref(w)

    @property
    def w(self):
        return self._weight()

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(y = x @ W^T + residual, RMSNorm(y) * norm_weight) [M, N] in one launch (`add_rms_norm_tile`, the
        activations quantized in it as a decode call does): a decode step's o_proj with the residual addition and the
        post-attention norm in its epilogue. None where that launch does not run (`fuses_add_norm`): the caller runs
        the GEMM and norm_rope.add_rms_norm. FP8Gemm and Int8Gemm: the subclass's `_path(x)` (its kernel variant for
        x's device) and `_plan(x, path, config, max_m, add_norm)` make the plan."""
        if not self.fuses_add_norm(x, residual, norm_weight):
            return None
        M = x.shape[0]
        x = x.contiguous()
        path = self._path(x)
        key = (next_pow2(M), x.dtype, path, "add_rms_norm")
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._plan(x, path, None, key[0], add_norm=True)
        return plan.run_add_norm(M, residual, norm_weight, eps, a_ptr=x, stride_am=x.stride(0))

    def fuses_add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
        """Whether `add_rms_norm` runs x, residual and norm_weight in one launch (GemmPlan's add_norm): a decode
        step (at most QUANTIZE_IN_GEMM_MAX_M rows, the GEMMs' decode bound) on the Triton backend, outside the
        batch-invariant mode (whose norm sums each row in one order), x [M, K] and residual [M, N] (contiguous) of
        one dtype (fp16 / bf16 / fp32) on the weight's device, norm_weight [N]; a plain GEMM's weight (no SwiGLU
        epilogue)."""
        M = x.shape[0]
        return (not self.silu_mul and x.dim() == 2 and M <= QUANTIZE_IN_GEMM_MAX_M and x.shape[1] == self.K
                and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
                and residual.shape == (M, self.N) and residual.dtype == x.dtype and residual.is_contiguous()
                and norm_weight.shape == (self.N,) and x.device == self.device and not batch_invariant()
                and backend(x) == "triton")


class GemmPlan:
    """A GEMM launch resolved once per (weight, M bucket, dtype): its `Launch` holds the kernel, the launch
    options and every argument that stays the same (weight tensors, N, K, flags, tiles, the split-K arrival
    counts); `run` allocates y (and the split-K partials), binds what changes per call and launches once.
    The grid is cdiv(M, block_m) row tiles by tiles_n column tiles by split_k slices, flattened to
    (row x column tiles, split_k) for the grouped-order kernels (`gemm_tile`). `per_call` names the
    arguments besides y, the partials and M that `run` binds each time; silu_mul: the launch's epilogue is
    SwiGLU's activation (`store_output`), y has N / 2 columns. add_norm_rows > 0: the launch's epilogue is the
    residual addition and RMSNorm (`add_rms_norm_tile`) for up to that many rows, run by `run_add_norm`."""

    def __init__(self, launch: Launch, y_name: str, per_call: tuple[str, ...], N: int, block_m: int, tiles_n: int,
                 split_k: int, flat: bool, silu_mul: bool = False, add_norm_rows: int = 0):
        per_call = (y_name, "partials_ptr", "M", *per_call) + (("arrivals_ptr",) if split_k == 1 else ())
        if add_norm_rows:  # one arrival count per row block (made now, before any graph capture)
            launch.args.update(ADD_NORM=True, row_arrivals_ptr=arrival_counts(-(add_norm_rows // -block_m),
                                                                              launch.args[y_name].device))
            if flat:  # add_rms_norm_tile's row block and column tile from program_id(0): no grouped order
                launch.args["GROUP_M"] = 1
            per_call += ("res_ptr", "norm_w_ptr", "h_ptr", "sumsq_ptr", "eps")
        for name in per_call:  # bound per call: the plan keeps no activations and no output
            del launch.args[name]
        self.launch, self.y_name, self.N = launch, y_name, N
        self.block_m, self.tiles_n, self.split_k, self.flat = block_m, tiles_n, split_k, flat
        self.out_cols = N // 2 if silu_mul else N

    def run(self, M: int, out_dtype: torch.dtype, device: torch.device, **bound) -> torch.Tensor:
        """y [M, N] (with the SwiGLU epilogue [M, N / 2]) in out_dtype on device, from the one launch with `bound`
        (activations, their strides)."""
        y = torch.empty((M, self.out_cols), dtype=out_dtype, device=device)
        rows = -(M // -self.block_m)
        grid = (rows * self.tiles_n, self.split_k) if self.flat else (rows, self.tiles_n, self.split_k)
        if self.split_k == 1:  # y stands in for the split-K buffers (unused)
            self.launch(grid, M=M, partials_ptr=y, arrivals_ptr=y, **{self.y_name: y}, **bound)
        else:
            partials = torch.empty((self.split_k, M, self.N), dtype=torch.float32, device=device)
            self.launch(grid, M=M, partials_ptr=partials, **{self.y_name: y}, **bound)
        return y

    def run_add_norm(self, M: int, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     **bound) -> tuple[torch.Tensor, torch.Tensor]:
        """(y = the GEMM + residual, RMSNorm(y) * norm_weight), both [M, N] in residual's dtype, from the one
        launch of a plan made with add_norm_rows >= M; `bound` as `run`'s."""
        h = torch.empty_like(residual)
        sumsq = torch.empty(self.tiles_n, M, dtype=torch.float32, device=residual.device)  # per column tile
        y = self.run(M, residual.dtype, residual.device, res_ptr=residual, norm_w_ptr=norm_weight, h_ptr=h,
                     sumsq_ptr=sumsq, eps=eps, **bound)
        return y, h


def shape_fields(shape_format: str) -> list[str]:
    """"BxSmaxxHxHkvxDqkxDv" -> ["B", "Smax", "H", "Hkv", "Dqk", "Dv"]: an x before a capital separates.
    A kernel's tuning shapes are written in its format (`tritonq.tune --shapes`)."""
    return re.split(r"x(?=[A-Z])", shape_format)


def unpack_shape(shape: tuple[int, ...], target: str, shape_format: str) -> tuple[int, ...]:
    """shape, checked to have one positive int per field of shape_format (ValueError otherwise)."""
    fields = shape_fields(shape_format)
    if len(shape) != len(fields) or min(shape) < 1:
        raise ValueError(f"{target} shape {'x'.join(map(str, shape))}: expected {len(fields)} positive ints "
                         f"{shape_format}")
    return shape


def tune_group_size(K: int) -> int:
    """Group size of the int4 weights the tuner and the AOT checks make with K inputs: 128 (AWQ/GPTQ's
    usual) where it divides K, else 32."""
    return 128 if K % 128 == 0 else 32
