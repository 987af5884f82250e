"""GGUF block-format dequantize-GEMM (Q4_1, Q5_x, Q2_K ... Q6_K, IQ4_NL, IQ4_XS): y = x @ W^T + bias.

Shapes and dtypes:
    x       [M, K] fp16 / bf16 / fp32
    w       GGUFWeight (tritonq.quant.weights): lo [K/8, N] int32 (low 4 bits of each code, packed along K), hi
            [K*(bits-4)/32, N] int32 or None (the bits above 4), scales [K/group, N] fp32, offsets [K/group, N]
            fp32 or None; a value is (q - zero) * scale (+ offset), group 32 or 16 (Q6_K); IQ4_NL / IQ4_XS:
            code[q] * scale with code the 16 fp32 levels.
    y       [M, N] in x.dtype; accumulation in fp32.

The load-time repack (formats/gguf.py) keeps the file's values exactly: the super-block's fp16 d times its
6- or 8-bit sub-block scale is exact in fp32, and so is every (q - zero) * scale product. Two ways into the dot:
  * fp32 weights (`_weight_tile`): each weight formed in fp32 with the gguf package's own one rounding (the
    offset's add), then cast to x's dtype for the dot; the code becomes a float without an int-to-float conversion
    (2^23 | q, as common.dequantize_int_tile does in fp32); a K tile holds BLOCK_K / group scale rows, broadcast
    over their group by a reshape.
  * the decode word path (WORD_DEQUANT, `word_dequant`: every format at M <= 8 in fp16 / bf16 from sm_80, fp16
    under the interpreter; `_diagonal_dot`): the codes become magic + q halves straight from the packed words
    (common.int4_words_to_magic, int4_gemm's PTX; Q5 / Q6_K's high bits merged by common.high_words_to_magic;
    IQ4's levels by common.code_pairs_lookup), x meets them in a dot whose 16 rows hold the K tile's groups
    (block-diagonal x), and each group's scale, zero and offset meet the dot's fp32 result: no weight is formed, so
    the weights are no longer the file's fp32 values rounded to x's dtype; the products are exact and the affine is
    applied in fp32 (docs/gguf.md).
Planes are K-packed and N-contiguous like Int4Weight's, so every weight load is a row of BLOCK_N words (16-byte
vectors).

MoE experts: `_gguf_moe_kernel`, fused_moe's expert GEMM over stacked GGUFWeight experts (kernels/moe's token
alignment and plan, its launcher dispatching here by the weight's type: `gguf_moe_launch`), each tile through the
same `_weight_tile`, or `_diagonal_dot` for Q4_K / Q4_1 at decode (row blocks of up to WORD_MAX_M rows).

Paths by M as int4_gemm's: M <= 16 (decode) split-K reduced in the launch
(`common.reduce_split_k`), else a tiled GEMM. `GGUFGemm` resolves config, grid and arguments once per M
bucket (`common.GemmPlan`): one launch per call. CPU backend: the weight's CPU form (kernels/cpu/lowbit.py:
the planes as they are, run by the C library's GGUF linear); `gguf_gemm_reference` (TRITONQ_BACKEND=torch) is
the oracle.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NoReturn

import torch
import triton
import triton.language as tl

from tritonq.kernels import backend, batch_invariant
from tritonq.kernels.cpu import lowbit as cpu_lowbit
from tritonq.kernels.int4_gemm import code_pair_table
from tritonq.kernels.common import (
    GemmPlan,
    Launch,
    WeightGemm,
    check_launch_config,
    code_pairs_lookup,
    config_rows,
    gemm_output,
    half_bit_tricks,
    high_words_to_magic,
    int4_words_to_magic,
    next_pow2,
    reduce_split_k,
    slot_sum_args,
    split_k_arrivals,
    store_output,
    sum_expert_slots,
    tuned_or_default,
    unpack_int_tile,
    upcast_dot,
)
from tritonq.quant.weights import GGUFWeight

SPLIT_K_MAX_M = 16  # M at or below which the split-K (decode) path runs
# BLOCK_K of the IQ4 expert GEMM: the level gather's address tile of two [64, 64] weight tiles spills on sm_80 / 89
# (Triton 3.6, 8 warps); 32 rows do not (tests/aot/test_fit.py)
CODE_BLOCK_K = 32
# M at or below which the decode word path runs: its scale and offset cost 2 R / group multiply-adds a weight on the
# dot's result (R rows), and at 16 rows Q4_K's loop (8.0 ALU a weight on sm_90) loses to the fp32 weights' (6.3)
WORD_MAX_M = 8


@dataclass(frozen=True)
class GGUFGemmConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _weight_tile(lo_ptr, hi_ptr, scales_ptr, offsets_ptr, code_ptr, k0, offs_n, mask_n, row_stride, K,
                 BITS: tl.constexpr, ZERO: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                 HAS_CODE: tl.constexpr, BLOCK_K: tl.constexpr):
    """W^T rows k0 .. k0 + BLOCK_K, columns offs_n: the [BLOCK_K, BLOCK_N] fp32 tile with the file's values (zero
    outside K and mask_n). The planes' rows are row_stride apart (their N: the weight's, or a stacked gate_up's)."""
    HIGH: tl.constexpr = BITS - 4
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    offs_lo = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(lo_ptr + offs_lo[:, None] * row_stride + offs_n[None, :],
                    mask=(offs_lo < K // 8)[:, None] & mask_n[None, :], other=0)
    q = unpack_int_tile(words, 4)
    if HIGH > 0:
        offs_hi = k0 * HIGH // 32 + tl.arange(0, BLOCK_K * HIGH // 32)
        high = tl.load(hi_ptr + offs_hi[:, None] * row_stride + offs_n[None, :],
                       mask=(offs_hi < K * HIGH // 32)[:, None] & mask_n[None, :], other=0)
        q = q | (unpack_int_tile(high, HIGH) << 4)
    offs_g = k0 // GROUP + tl.arange(0, GROUPS)
    mask_g = (offs_g < K // GROUP)[:, None] & mask_n[None, :]
    s = tl.load(scales_ptr + offs_g[:, None] * row_stride + offs_n[None, :], mask=mask_g, other=0.0)
    if HAS_CODE:  # IQ4: q indexes 16 fp32 levels (64 bytes, in L1)
        v = tl.load(code_ptr + q)
    else:  # q - zero exactly, as an fp32 (2^23 + q has ulp 1)
        v = (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + ZERO)
    # then the format's scale and offset, in fp32
    v = tl.reshape(v, (GROUPS, GROUP, offs_n.shape[0])) * s[:, None, :]
    if HAS_OFFSETS:
        v += tl.load(offsets_ptr + offs_g[:, None] * row_stride + offs_n[None, :], mask=mask_g,
                     other=0.0)[:, None, :]
    return tl.reshape(v, (BLOCK_K, offs_n.shape[0]))


@triton.jit
def _dot(x, w, acc, UPCAST_DOT: tl.constexpr):
    """acc + x @ w, w the fp32 tile: exact fp32 (ieee) for fp32 x (and bf16 under the interpreter), else in x's
    dtype (the weight rounded once) with fp32 accumulation."""
    if UPCAST_DOT:
        return tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
    return tl.dot(x, w.to(x.dtype), acc)


@triton.jit
def _diagonal_dot(acc, x_ptr, rows, mask_m, dot_rows, diag, stride_xm, stride_xk, lo_ptr, hi_ptr, scales_ptr,
                  offsets_ptr, pairs, k0, offs_n, mask_n, N, K, BITS: tl.constexpr, ZERO: tl.constexpr,
                  GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_CODE: tl.constexpr, EVEN_K: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [GROUPS * ROWS, BLOCK_N] + the K tile k0 .. k0 + BLOCK_K of the decode word path for ROWS rows of x
    (rows, mask_m). The tile's GROUPS groups share one dot whose rows are group-major (row j * ROWS + m, dot_rows:
    x row m over group j, the other groups' columns zero: `diag`), so each dot row meets one group's scale and
    offset row on the dot's fp32 result: one multiply-add per dot row and column for the tile, not per group.
    The codes become magic + q halves straight from the packed words (`common.int4_words_to_magic`, with the 5th /
    6th bits `common.high_words_to_magic`); every product of the dot is exact. The magic and the zero go into the
    offset term, s * dot(x, magic + q) + (o - s * (magic + zero)) * sum(x) (o = 0 without offsets): a cancellation
    of the magic's share in fp32 (no longer the fp32 weight of `_weight_tile`). IQ4 (HAS_CODE): the levels
    themselves as halves, two a 4-byte lookup (`common.code_pairs_lookup` in `pairs`, the int32 [256] table of
    int4_gemm.code_pair_table the caller loaded once; IQ4's integer levels are exact in fp16 and bf16),
    s * dot(x, level). EVEN_K: no
    column past K."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    HIGH: tl.constexpr = BITS - 4
    cols = tl.arange(0, BLOCK_K)
    offs_k = k0 + cols
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    rows_g = k0 // GROUP + tl.arange(0, GROUPS * ROWS) // ROWS  # the group of each dot row
    x_ptrs = x_ptr + dot_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    if EVEN_K:
        x = tl.load(x_ptrs, mask=diag, other=0.0)
        words = tl.load(lo_ptr + offs_w[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        mask_s = mask_n[None, :]
    else:
        x = tl.load(x_ptrs, mask=diag & (offs_k < K)[None, :], other=0.0)
        words = tl.load(lo_ptr + offs_w[:, None] * N + offs_n[None, :],
                        mask=(offs_w < K // 8)[:, None] & mask_n[None, :], other=0)
        mask_s = (rows_g < K // GROUP)[:, None] & mask_n[None, :]
    s = tl.load(scales_ptr + rows_g[:, None] * N + offs_n[None, :], mask=mask_s, other=0.0)
    if x.dtype == tl.float16:
        magic: tl.constexpr = 1024.0
    else:
        magic: tl.constexpr = 128.0
    if HAS_CODE:
        return acc + tl.dot(x, code_pairs_lookup(words, pairs, x.dtype)) * s
    if HIGH > 0:  # the words of the high plane: 32 / HIGH codes each (K is whole blocks of them)
        offs_h = k0 * HIGH // 32 + tl.arange(0, BLOCK_K * HIGH // 32)
        mask_h = mask_n[None, :] if EVEN_K else (offs_h < K * HIGH // 32)[:, None] & mask_n[None, :]
        high = tl.load(hi_ptr + offs_h[:, None] * N + offs_n[None, :], mask=mask_h, other=0)
        h = high_words_to_magic(words, high, HIGH, x.dtype)
    else:
        h = int4_words_to_magic(words, x.dtype)
    c = -s * (magic + ZERO)
    if HAS_OFFSETS:
        c += tl.load(offsets_ptr + rows_g[:, None] * N + offs_n[None, :], mask=mask_s, other=0.0)
    # sum(x) per (group, row) from the plain [ROWS, BLOCK_K] rows, put in the dot's group-major row order
    xm = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                 mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
    xs = tl.reshape(tl.trans(tl.sum(tl.reshape(xm.to(tl.float32), (ROWS, GROUPS, GROUP)), axis=2)), (GROUPS * ROWS,))
    return acc + tl.dot(x, h) * s + xs[:, None] * c


@triton.jit
def _gguf_gemm_kernel(
    x_ptr, lo_ptr, hi_ptr, scales_ptr, offsets_ptr, code_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_xk,
    BITS: tl.constexpr, ZERO: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_CODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr, WORD_DEQUANT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    partials_ptr, arrivals_ptr,
):
    """One program: a [ROWS, BLOCK_N] output tile over K slice pid_k (of SPLIT_K); with SPLIT_K > 1 the slices meet
    in `common.reduce_split_k`. ROWS = BLOCK_M, the dot's rows, except on the decode word path (WORD_DEQUANT,
    `_diagonal_dot`), whose dot rows hold the K tile's BLOCK_K / GROUP groups of ROWS = BLOCK_M * GROUP / BLOCK_K
    rows of x each (1 at BLOCK_K 512); else each K tile's fp32 weights (`_weight_tile`) meet x in one dot."""
    ROWS: tl.constexpr = BLOCK_M * GROUP // BLOCK_K if WORD_DEQUANT else BLOCK_M
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    offs_m = pid_m * ROWS + tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    if WORD_DEQUANT:  # dot row j * ROWS + m: x row m over group j of the K tile
        r = tl.arange(0, BLOCK_M)
        dot_rows = (pid_m * ROWS + r % ROWS).to(tl.int64)
        diag = ((dot_rows < M)[:, None] & ((tl.arange(0, BLOCK_K) // GROUP)[None, :] == (r // ROWS)[:, None]))
        acc_dot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        pairs = code_ptr
        if HAS_CODE:  # IQ4's 256-entry pair table, loaded once: the loop's lookups gather from it
            pairs = tl.load(code_ptr + tl.arange(0, 256))
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            acc_dot = _diagonal_dot(acc_dot, x_ptr, rows, mask_m, dot_rows, diag, stride_xm, stride_xk, lo_ptr,
                                    hi_ptr, scales_ptr, offsets_ptr, pairs, k0, offs_n, mask_n, N, K, BITS, ZERO,
                                    GROUP, HAS_OFFSETS, HAS_CODE, EVEN_K, ROWS, BLOCK_K)
        acc = tl.sum(tl.reshape(acc_dot, (BLOCK_K // GROUP, ROWS, BLOCK_N)), axis=0)
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
            w = _weight_tile(lo_ptr, hi_ptr, scales_ptr, offsets_ptr, code_ptr, k0, offs_n, mask_n, N, K,
                             BITS, ZERO, GROUP, HAS_OFFSETS, HAS_CODE, BLOCK_K)
            acc = _dot(x, w, acc, UPCAST_DOT)

    if HAS_BIAS:  # added once: by the first K slice only
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SPLIT_K > 1:
        total, last = reduce_split_k(acc, partials_ptr, arrivals_ptr, pid_m * tl.num_programs(1) + pid_n, pid_k,
                                     rows, offs_n, mask_m, mask_n, M, N, SPLIT_K)
        if last:
            store_output(out_ptr, total, rows, offs_n, mask_m, N, N, False)
    else:
        store_output(out_ptr, acc, rows, offs_n, mask_m, N, N, False)


def default_config(M: int, N: int, K: int, word: bool = False, group: int = 32, one_stage: bool = False
                   ) -> GGUFGemmConfig:
    """Defaults in code, used when no tuned JSON entry exists for this GPU and shape. word (`word_dequant`): the
    decode word path's tile (`_diagonal_dot`), M rounded up to a power of two (R) rows of x over a K tile of
    16 group / R (at least 128), so that its groups fill 16 dot rows (32 at R = 8 for groups of 32, 64 for 16); 64
    columns over 8 warps, 2 stages (3 take more registers and instructions). Not 128 columns: the dot's B tile goes through shared memory, 180 KB at
    M = 1, over sm_80's and sm_86 / 89's limits, and sm_90 spills 8 B under Triton 3.6. one_stage (Q5's 1-bit plane,
    IQ4's pair gather): with two stages Q5's loop spills 8 B on sm_80 and IQ4's gather takes 144 KB of shared memory
    (over sm_89's) under Triton 3.6; Q6_K keeps two (one spills 4 B on sm_90 under Triton 3.9)."""
    if M <= SPLIT_K_MAX_M:
        rows = next_pow2(M)
        block_n, block_k = (64, max(128, 16 * group // rows)) if word else (64, 128)
        split_k = max(1, min(16, next_pow2(triton.cdiv(264, triton.cdiv(N, block_n))), triton.cdiv(K, block_k) // 2))
        if word:
            return GGUFGemmConfig(rows * block_k // group, block_n, block_k, split_k, num_warps=8,
                                  num_stages=1 if one_stage else 2)
        return GGUFGemmConfig(16, block_n, block_k, split_k, num_warps=4, num_stages=4)
    if M <= 64:
        return GGUFGemmConfig(max(16, next_pow2(M)), 64, 64, 1, num_warps=4, num_stages=4)
    return GGUFGemmConfig(128, 128, 64, 1, num_warps=8, num_stages=3)


def word_dequant(x: torch.Tensor, w: GGUFWeight, rows: int, cc: int | None = None) -> bool:
    """The WORD_DEQUANT flag, decided once per plan: up to WORD_MAX_M rows (rows: the M the config is chosen for,
    `config_rows`) of any format, with fp16 / bf16 activations on a GPU from sm_80 (`common.half_bit_tricks`: fp16
    only under the interpreter; cc the target of meta tensors, None: sm_80+). Everything else (more rows, fp32, sm_75,
    the batch-invariant mode's one config) forms the fp32 weights (`_weight_tile`)."""
    return rows <= WORD_MAX_M and half_bit_tricks(x, cc)


def expert_word_dequant(x: torch.Tensor, w: GGUFWeight, rows: int, cc: int | None = None) -> bool:
    """The expert kernel's WORD_DEQUANT: `word_dequant`'s rule for 4-bit codes without a level table (Q4_K, Q4_1),
    the experts its tile (kernels/moe's `gguf_word_config`) was measured for; the others form fp32 weights."""
    return w.bits == 4 and w.code is None and word_dequant(x, w, rows, cc)


def config_bucket(M: int, N: int, K: int, w: GGUFWeight) -> str:
    """Key of the tuned-config JSON: M rounded up to a power of two; exact N, K and the block type."""
    return f"M{next_pow2(M)}_N{N}_K{K}_{w.type_name}"


def _fail(name: str, found, expected: str, fix: str) -> NoReturn:
    raise ValueError(f"gguf_gemm: {name} is {found}, expected {expected}; {fix}")


def _check_weight(w: GGUFWeight) -> tuple[int, int]:
    """Validate a GGUFWeight's planes; returns (N, K)."""
    if not isinstance(w, GGUFWeight):
        _fail("w", type(w).__name__, "GGUFWeight", "load it through tritonq.formats.gguf")
    if w.bits not in (4, 5, 6) or w.group_size not in (16, 32):
        _fail("(bits, group_size)", (w.bits, w.group_size), "bits 4 / 5 / 6, group 16 or 32",
              "repack with tritonq.formats.gguf")
    N, K = w.shape
    groups = (torch.float32, (K // w.group_size, N))
    expected = {"lo": (torch.int32, (K // 8, N)), "hi": (torch.int32, (K * (w.bits - 4) // 32, N)),
                "scales": groups, "offsets": groups, "bias": (w.bias.dtype if w.bias is not None else None, (N,)),
                "code": (torch.float32, (16,))}
    if w.code is not None and (w.bits != 4 or w.zero or w.offsets is not None):
        _fail("code", f"set with bits={w.bits}, zero={w.zero}, offsets {w.offsets is not None}",
              "a code table with 4-bit codes, zero 0 and no offsets (IQ4_NL / IQ4_XS)",
              "repack with tritonq.formats.gguf")
    for name, (dtype, shape) in expected.items():
        t = getattr(w, name)
        if t is None and (name != "hi" or w.bits == 4):
            continue
        if t is None or (name == "hi" and w.bits == 4) or t.dtype != dtype or tuple(t.shape) != shape:
            _fail(name, None if t is None else f"{t.dtype} of shape {tuple(t.shape)}",
                  "None" if name == "hi" and w.bits == 4 else f"{dtype} {list(shape)}",
                  "repack with tritonq.formats.gguf")
        if not t.is_contiguous():
            _fail(name, f"non-contiguous with strides {t.stride()}", "a contiguous tensor",
                  "call .contiguous() at load")
    return N, K


class GGUFGemm(WeightGemm):
    """gguf_gemm over one weight, checked once here. Per (M bucket, x dtype) the config, grid and launch
    arguments are resolved once (`GemmPlan`); a call checks x, picks the backend and runs one launch."""

    HAS_ADD_NORM_EPILOGUE = False  # formats.layers runs the GEMM, then norm_rope.add_rms_norm

    def __init__(self, w: GGUFWeight):
        self.N, self.K = _check_weight(w)
        super().__init__(w)
        self.device, self.plans = w.lo.device, {}
        self.cpu = cpu_lowbit.prepare(w) if backend(w.lo) == "cpu" else None

    def __call__(self, x: torch.Tensor, config: GGUFGemmConfig | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.K or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            _fail("x", f"{x.dtype} of shape {tuple(x.shape)}", f"fp16/bf16/fp32 [M, {self.K}]",
                  "flatten leading dims to M first")
        if x.device != self.device:
            _fail("x", f"on {x.device}", f"on the weight's device {self.device}", "move x or the weight")
        b = backend(x)
        if b == "cpu":  # the CPU form made once (kernels/cpu/lowbit.py)
            return cpu_lowbit.linear(x, self.cpu if self.cpu is not None else cpu_lowbit.prepare(self.w))
        if b == "torch":
            return gguf_gemm_reference(x, self.w)
        M = x.shape[0]
        if config is not None:
            plan = _plan(x, self.w, config, M, word_dequant(x, self.w, config_rows(M)))
        else:
            key = (next_pow2(M), x.dtype, batch_invariant())
            plan = self.plans.get(key)
            if plan is None:
                rows = config_rows(M)  # M, or one row count for every M in the batch-invariant mode
                word = word_dequant(x, self.w, rows)
                config = tuned_or_default("gguf_gemm", config_bucket(rows, self.N, self.K, self.w),
                                          default_config(rows, self.N, self.K, word, self.w.group_size,
                                                         self.w.bits == 5 or self.w.code is not None))
                plan = self.plans[key] = _plan(x, self.w, config, key[0], word)
        return plan.run(M, x.dtype, self.device, x_ptr=x, stride_xm=x.stride(0), stride_xk=x.stride(1))


def _plan(x: torch.Tensor, w: GGUFWeight, config: GGUFGemmConfig, max_m: int, word: bool) -> GemmPlan:
    check_launch_config("gguf_gemm", config, GGUFGemmConfig)
    tile = replace(config, BLOCK_M=program_rows(config, w, word))  # the output tile: rows of y per program
    launch = gguf_gemm_launch(x, w, config, split_k_arrivals(max_m, w.shape[0], tile, x.device), word)[0]
    return GemmPlan(launch, "out_ptr", ("x_ptr", "stride_xm", "stride_xk"), w.shape[0], tile.BLOCK_M,
                    triton.cdiv(w.shape[0], config.BLOCK_N), config.SPLIT_K, flat=False)


def program_rows(config: GGUFGemmConfig, w: GGUFWeight, word: bool) -> int:
    """Rows of x (and y) one program covers: BLOCK_M, or on the decode word path BLOCK_M * group / BLOCK_K (its dot
    rows hold one group of that many rows each; `_diagonal_dot`), which needs 1 to BLOCK_M groups in a K tile."""
    if not word:
        return config.BLOCK_M
    if not w.group_size <= config.BLOCK_K <= config.BLOCK_M * w.group_size:
        _fail("BLOCK_K of the decode word path", config.BLOCK_K,
              f"{w.group_size} to BLOCK_M * {w.group_size} = {config.BLOCK_M * w.group_size} (one to BLOCK_M groups "
              "in the dot's rows)", "take default_config's decode tile")
    return config.BLOCK_M * w.group_size // config.BLOCK_K


def gguf_gemm_launch(x: torch.Tensor, w: GGUFWeight, config: GGUFGemmConfig, arrivals: torch.Tensor | None = None,
                     word: bool = False) -> tuple[Launch, torch.Tensor]:
    """The launch of _gguf_gemm_kernel for x [M, K] @ w (both checked by the caller) with `config`, and its
    output y [M, N]; over meta tensors what the AOT tests compile. BLOCK_K is at least 32 (a word of Q5's
    fifth bits) and at most K rounded up to a power of two; word: the decode word path (`word_dequant`), whose
    BLOCK_K (as configured) holds BLOCK_K / group groups of `program_rows` rows of x in its BLOCK_M dot rows."""
    (M, K), N = x.shape, w.shape[0]
    rows = program_rows(config, w, word)
    block_k = config.BLOCK_K if word else max(32, min(config.BLOCK_K, next_pow2(K)))
    out, partials, arrivals = gemm_output(M, N, replace(config, BLOCK_M=rows), x.dtype, x.device, arrivals)
    args = dict(
        x_ptr=x, lo_ptr=w.lo, hi_ptr=w.hi if w.hi is not None else w.lo, scales_ptr=w.scales,
        offsets_ptr=w.offsets if w.offsets is not None else w.scales,
        code_ptr=w.scales if w.code is None else code_pair_table(w.code, x.dtype) if word else w.code,
        bias_ptr=w.bias if w.bias is not None else w.scales, out_ptr=out, M=M, N=N, K=K,
        stride_xm=x.stride(0), stride_xk=x.stride(1), BITS=w.bits, ZERO=w.zero, GROUP=w.group_size,
        HAS_OFFSETS=w.offsets is not None, HAS_CODE=w.code is not None, HAS_BIAS=w.bias is not None,
        UPCAST_DOT=upcast_dot(x), WORD_DEQUANT=word, EVEN_K=K % block_k == 0,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=block_k, SPLIT_K=config.SPLIT_K,
        partials_ptr=partials, arrivals_ptr=arrivals)
    grid = (triton.cdiv(M, rows), triton.cdiv(N, config.BLOCK_N), config.SPLIT_K)
    return Launch(_gguf_gemm_kernel, grid, args, config.num_warps, config.num_stages), out


@triton.jit
def _gguf_moe_kernel(a_ptr, out_ptr, lo_ptr, hi_ptr, scales_ptr, offsets_ptr, code_ptr, routing_weight_ptr,
                     sorted_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr, num_valid, N, K, W_N, up_offset,
                     a_row_divisor, stride_am, stride_om, stride_le, stride_he, stride_se,
                     a_scale_ptr, stride_asm, stride_asg,
                     BITS: tl.constexpr, ZERO: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                     HAS_CODE: tl.constexpr, GATE_UP: tl.constexpr, UPCAST_DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, sum_ptr=None,
                     topk_ids_ptr=None, arrivals_ptr=None, top_k=1, SUM_SLOTS: tl.constexpr = False,
                     WORD_DEQUANT: tl.constexpr = False, EVEN_K: tl.constexpr = False, PART: tl.constexpr = False):
    """One program: BLOCK_M rows of the expert-sorted (token, slot) pairs (one expert: kernels/moe/routing.py's
    alignment) x OUT_N output columns of the expert's GGUF planes. As kernels/moe/jit.py's expert GEMM: GATE_UP
    out[:, n] = silu(A @ W[n]) * (A @ W[n + up_offset]) with A the tokens; PART (the gate or the up of experts whose
    gate and up differ in type) out = A @ W^T, A the tokens; else out = routing weight * (A @ W^T) with A the
    (token, slot) rows, and with SUM_SLOTS sum [T, N] = each token's rows added over its slots
    (`common.sum_expert_slots`, as there). W_N: the planes' row length.
    The weights: the fp32 tiles of `_weight_tile` (OUT_N = BLOCK_N; gate/up: one tile each), or the decode word
    path (WORD_DEQUANT, `_diagonal_dot`, as _gguf_gemm_kernel's): the dot's rows hold the K tile's BLOCK_K / GROUP
    groups of the BLOCK_M rows, and its BLOCK_N columns are the output's, or with GATE_UP the BLOCK_N / 2 gate
    columns and their up columns (OUT_N = BLOCK_N / 2: one dot, one x tile for both). EVEN_K: no tile past K.
    a_scale_ptr, stride_asm, stride_asg: unused (no W8A8 here); fused_moe's plan binds them to every expert GEMM."""
    OUT_N: tl.constexpr = BLOCK_N // 2 if WORD_DEQUANT and GATE_UP else BLOCK_N
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    post_padded = tl.load(num_tokens_post_padded_ptr)
    stop = pid_m * BLOCK_M >= post_padded  # past the last padded expert run
    if SUM_SLOTS:  # the first row block arrives at the slot sum in any case
        stop = stop & (pid_m > 0)
    if stop:
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_ok = (rows < num_valid) & (offs_m < post_padded)  # padding slots hold the sentinel num_valid
    a_rows = (rows // a_row_divisor).to(tl.int64)
    offs_n = pid_n * OUT_N + tl.arange(0, OUT_N)
    mask_n = offs_n < N
    lo_ptr += expert * stride_le
    hi_ptr += expert * stride_he
    scales_ptr += expert * stride_se
    offsets_ptr += expert * stride_se
    code_ptr += expert * 16
    if WORD_DEQUANT:
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        # dot row j * BLOCK_M + m: sorted row m over group j of the K tile
        r = tl.arange(0, GROUPS * BLOCK_M) % BLOCK_M
        dot_ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + r)
        dot_ok = (dot_ids < num_valid) & (pid_m * BLOCK_M + r < post_padded)
        dot_rows = (dot_ids // a_row_divisor).to(tl.int64)
        diag = dot_ok[:, None] & ((tl.arange(0, BLOCK_K) // GROUP)[None, :]
                                  == (tl.arange(0, GROUPS * BLOCK_M) // BLOCK_M)[:, None])
        # the dot's columns: the output's, then (GATE_UP) the same columns of the up rows
        c = tl.arange(0, BLOCK_N)
        cols = pid_n * OUT_N + c % OUT_N
        word_n = cols + c // OUT_N * up_offset
        acc_dot = tl.zeros((GROUPS * BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_dot = _diagonal_dot(acc_dot, a_ptr, a_rows, row_ok, dot_rows, diag, stride_am, 1, lo_ptr, hi_ptr,
                                    scales_ptr, offsets_ptr, code_ptr, k0, word_n, cols < N, W_N, K, BITS, ZERO,
                                    GROUP, HAS_OFFSETS, HAS_CODE, EVEN_K, BLOCK_M, BLOCK_K)
        acc = tl.sum(tl.reshape(acc_dot, (GROUPS, BLOCK_M, BLOCK_N)), axis=0)
        if GATE_UP:
            acc, acc_up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, OUT_N)), (0, 2, 1)))
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                        mask=row_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            w = _weight_tile(lo_ptr, hi_ptr, scales_ptr, offsets_ptr, code_ptr, k0, offs_n, mask_n, W_N, K,
                             BITS, ZERO, GROUP, HAS_OFFSETS, HAS_CODE, BLOCK_K)
            acc = _dot(a, w, acc, UPCAST_DOT)
            if GATE_UP:
                w_up = _weight_tile(lo_ptr, hi_ptr, scales_ptr, offsets_ptr, code_ptr, k0, offs_n + up_offset,
                                    mask_n, W_N, K, BITS, ZERO, GROUP, HAS_OFFSETS, HAS_CODE, BLOCK_K)
                acc_up = _dot(a, w_up, acc_up, UPCAST_DOT)
    if GATE_UP:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, in fp32
    elif not PART:
        acc = acc * tl.load(routing_weight_ptr + rows, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_n[None, :])
    if SUM_SLOTS:
        sum_expert_slots(out_ptr, sum_ptr, topk_ids_ptr, arrivals_ptr, pid_n, offs_n, N, num_valid // top_k, top_k,
                         tl.maximum(post_padded // BLOCK_M, 1), BLOCK_M)


def gguf_moe_launch(a: torch.Tensor, out: torch.Tensor, w: GGUFWeight, routing: torch.Tensor, alignment: tuple,
                    top_k: int, config, block_m: int, gate_up: bool, activation=None,
                    slot_sum: tuple | None = None, cc: int | None = None, part: bool = False) -> Launch:
    """The launch of _gguf_moe_kernel for one of fused_moe's two GEMMs over stacked GGUF experts w (checked by
    `GGUFWeight.stacked_shape`): gate_up a = x [T, D], w [E, 2I, D] (gate rows, then up), out = hidden [T*k, I];
    else a = hidden [T*k, I], w [E, D, I], out [T*k, D]. alignment, config (a kernels.moe MoEConfig), block_m and
    slot_sum (down: the sum over each token's slots) and part (one of a gate and an up of different types: a = x, no
    activation or routing weight) as kernels/moe's `moe_gemm_launch`. Up to WORD_MAX_M rows
    a block (block_m) of Q4_K / Q4_1 experts take the decode word path (`expert_word_dequant`; cc as there) over
    config's BLOCK_K (taken down to K rounded up to a power of two, not below the group); else BLOCK_K is taken to
    at least 32 (a word of Q5's fifth bits), and to 32 for IQ4 (CODE_BLOCK_K). SiLU-and-mul only: GGUF experts
    (qwen3moe) have no biases and no other activation."""
    if w.bias is not None or activation is not None:
        _fail("(bias, activation)", (w.bias is not None, activation), "no bias and SiLU-and-mul (None)",
              "GGUF experts run Qwen3-MoE's plain SwiGLU experts")
    sorted_ids, expert_ids, post_padded = alignment
    (N, K), W_N = (out.shape[1], a.shape[1]), w.shape[0]
    word = expert_word_dequant(a, w, block_m, cc)
    if word:
        block_k = max(w.group_size, min(config.BLOCK_K, next_pow2(K)))
    else:
        block_k = max(32, min(config.BLOCK_K, next_pow2(K), CODE_BLOCK_K if w.code is not None else config.BLOCK_K))
    out_n = config.BLOCK_N // 2 if word and gate_up else config.BLOCK_N  # the kernel's OUT_N
    args = dict(a_ptr=a, out_ptr=out, lo_ptr=w.lo, hi_ptr=w.hi if w.hi is not None else w.lo, scales_ptr=w.scales,
                offsets_ptr=w.offsets if w.offsets is not None else w.scales,
                code_ptr=w.code if w.code is not None else w.scales, routing_weight_ptr=routing,
                sorted_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids, num_tokens_post_padded_ptr=post_padded,
                num_valid=routing.numel(), N=N, K=K, W_N=W_N, up_offset=N if gate_up else 0,
                a_row_divisor=top_k if gate_up or part else 1, stride_am=a.stride(0), stride_om=out.stride(0),
                a_scale_ptr=routing, stride_asm=0, stride_asg=0, stride_le=w.lo.stride(0),
                stride_he=w.hi.stride(0) if w.hi is not None else 0,
                stride_se=w.scales.stride(0), BITS=w.bits, ZERO=w.zero, GROUP=w.group_size,
                HAS_OFFSETS=w.offsets is not None, HAS_CODE=w.code is not None, GATE_UP=gate_up,
                UPCAST_DOT=upcast_dot(a), BLOCK_M=block_m, BLOCK_N=config.BLOCK_N, BLOCK_K=block_k,
                WORD_DEQUANT=word, EVEN_K=K % block_k == 0, PART=part, **slot_sum_args(slot_sum, top_k))
    grid = (expert_ids.numel(), triton.cdiv(N, out_n))
    return Launch(_gguf_moe_kernel, grid, args, config.num_warps, config.num_stages)


def gguf_gemm_reference(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """Plain torch: dequantize (fp32) -> fp32 matmul (+ bias) -> x.dtype. The oracle (TRITONQ_BACKEND=torch)."""
    _check_weight(w)
    y = x.float() @ w.dequantize().t()
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(x.dtype)


def _meta_weight(N: int, K: int, bits: int, group: int, offsets: bool, code: bool, *experts: int) -> GGUFWeight:
    """A GGUFWeight of meta tensors: N x K, `bits`-bit codes, scales per `group`, offsets or not, a code table (IQ4)
    or not; `experts` (E,): stacked."""
    meta = torch.device("meta")
    scales = torch.empty(*experts, K // group, N, dtype=torch.float32, device=meta)
    return GGUFWeight(torch.empty(*experts, K // 8, N, dtype=torch.int32, device=meta),
                      torch.empty(*experts, K * (bits - 4) // 32, N, dtype=torch.int32, device=meta) if bits > 4
                      else None,
                      scales, torch.empty_like(scales) if offsets else None, group, bits, 0, f"{bits}-bit",
                      code=torch.empty(*experts, 16, device=meta) if code else None)


def aot_launch(config: GGUFGemmConfig | None, M: int, N: int, K: int, bits: int, group: int, offsets: bool,
               dtype: torch.dtype = torch.bfloat16, code: bool = False, cc: int | None = None) -> Launch:
    """`gguf_gemm_launch` over meta tensors for an N x K weight of `bits`-bit codes, scales per `group`, with
    offsets or not (Q4_K: 4, 32, True; Q5_K: 5, 32, True; Q6_K: 6, 16, False), a code table (IQ4) or not, no bias,
    as the runtime builds it for sm_`cc` (None: sm_80+); config None: the default config."""
    w = _meta_weight(N, K, bits, group, offsets, code)
    x = torch.empty(M, K, dtype=dtype, device="meta")
    word = word_dequant(x, w, M, cc)
    return gguf_gemm_launch(x, w, config or default_config(M, N, K, word, group, bits == 5 or code),
                            word=word)[0]


def aot_moe_launch(config, problem: tuple[int, int, int, int, int], gate_up: bool, bits: int, group: int,
                   offsets: bool, dtype: torch.dtype = torch.bfloat16, code: bool = False,
                   cc: int | None = None) -> Launch:
    """`gguf_moe_launch` over meta tensors for one GEMM of fused_moe over stacked GGUF experts (format as
    `aot_launch`'s) for sm_`cc` (None: sm_80+); problem (tokens, experts, top-k, D, I), config a kernels.moe MoEConfig
    (its BLOCK_M the row block)."""
    T, E, top_k, D, inter = problem
    N, K, w_rows = (inter, D, 2 * inter) if gate_up else (D, inter, D)
    meta = torch.device("meta")
    numel = T * top_k
    max_blocks = min(numel, triton.cdiv(numel, config.BLOCK_M) + E + 1)  # as moe_align_block_size
    alignment = (torch.empty(max_blocks * config.BLOCK_M, dtype=torch.int32, device=meta),
                 torch.empty(max_blocks, dtype=torch.int32, device=meta), torch.empty(1, dtype=torch.int32, device=meta))
    a = torch.empty(T if gate_up else numel, K, dtype=dtype, device=meta)
    slot_sum = None if gate_up else (torch.empty(T, N, dtype=dtype, device=meta),
                                     torch.empty(T, top_k, dtype=torch.int32, device=meta),
                                     torch.empty(triton.cdiv(N, config.BLOCK_N), dtype=torch.int32, device=meta))
    return gguf_moe_launch(a, torch.empty(numel, N, dtype=dtype, device=meta),
                           _meta_weight(w_rows, K, bits, group, offsets, code, E),
                           torch.empty(numel, dtype=torch.float32, device=meta), alignment, top_k, config,
                           config.BLOCK_M, gate_up, slot_sum=slot_sum, cc=cc)
