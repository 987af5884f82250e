"""int4 / int8 weight-only dequantize-GEMM (W4A16, GPTQ 8-bit): y = x @ dequant(w)^T + bias.

Shapes and dtypes:
    x       [M, K] fp16 / bf16 / fp32
    w       Int4Weight (tritonq.formats.base): qweight [K*bits/32, N] int32 packed along K in
            sequential order, scales [G, N] fp16/bf16/fp32, zeros [G, N] (same dtype) or None for
            symmetric weights (zero = 2^(bits-1)), g_idx [K] int32 or None; or, for bitsandbytes
            nf4 / fp4, code [16] fp32 (the 4-bit q indexes it) with fp32 block absmax as scales.
    y       [M, N] in x.dtype; accumulation in fp32.

Layout choice: AWQ and GPTQ are both repacked at load time (formats/awq.py, formats/gptq.py) into GPTQ's
K-packed, N-contiguous qweight. Packing along K lets one int32 load per (k-word, n) feed all
BLOCK_N columns of a tile with unit-stride, coalesced loads along N, keeps the N dimension free
for tensor-parallel column splits, and is GPTQ's native layout (no repack for the common case).
Zeros are stored unpacked as floats: they are [G, N], 1/group_size of the weight, so the extra
bytes are negligible and the kernel avoids a second unpack.

Two paths over the same kernel, chosen by M (`SPLIT_K_MAX_M`):
  * M <= 16 (decode): BLOCK_M = 16 and split-K. N / BLOCK_N tiles alone cannot fill the SMs at
    small M, so the K loop is cut into SPLIT_K slices; each slice writes an fp32 partial into
    its own plane of a [SPLIT_K, M, N] buffer and the last slice to finish adds them in slice
    order and casts, in the same launch (`common.reduce_split_k`). This is deterministic (fp32
    atomics are not) and exact to fp32 rounding; the buffer is SPLIT_K * M * N fp32, tiny next
    to the weight at M <= 16.
  * M > 16: a tiled tensor-core GEMM, SPLIT_K = 1, written straight to y in x.dtype.

Dequantization: 4- and 8-bit codes with scales in x's half dtype go from the packed words to half pairs by inline
PTX (WORD_DEQUANT, `common.int4_words_minus_zero` / `int8_words_minus_zero`, sm_80+), the scale on the dot's fp32
result where the tile has one scale row and fewer rows than BLOCK_K (decode); a code table's values come by pairs of
codes from a 256-entry table (CODE_PAIRS, `common.code_pairs_lookup`, same conditions), the absmax on the dot's
result; everything else through `unpack_int_tile` + `dequantize_int_tile` (a code table gathered per element from
its 64 bytes, W = code[q] * absmax).

Groups: when there is no g_idx and group_size is a multiple of BLOCK_K, every K tile lies in
one group, so one [BLOCK_N] row of scales/zeros is loaded per tile (TILE_GROUPS). An act-order weight is
sorted by group once, when its `Int4Gemm` is made (`sort_act_order`: qweight repacked, the permutation in the
weight's perm) and the kernel reads x's columns through it (PERMUTE_X), so its groups are plain ones.
Otherwise (a g_idx whose groups do not sort into runs of group_size rows, or a group size that BLOCK_K does not
divide) scales/zeros are gathered per row as a [BLOCK_K, BLOCK_N] tile; these rows hit L1/L2 since G << K.

CPU (no interpreter): torch's int4 CPU kernel (4-bit, M <= 32; above, the weight unpacked per call to
bf16 and a bf16 GEMM) or a once-dequantized fp32 weight (8-bit) over the weight prepared once per
object, see kernels/cpu/lowbit.py; `int4_gemm_reference`
(TRITONQ_BACKEND=torch) is the oracle.

Launch configs: `Int4GemmConfig`; defaults in `default_config`, tuned JSON overrides through
`common.tuned_or_default("int4_gemm", config_bucket(M, N, K, w), ...)`, looked up once per (weight,
M bucket) by the weight's `Int4Gemm`, which keeps the launch in a `common.GemmPlan`. `int4_gemm_launch`
builds every launch (the plans', tune --aot's over meta tensors); `sweep_space` is what
`python -m tritonq.tune --kernel int4_gemm` sweeps (`CONFIG_SPACE` restricted per shape; tune/targets.py).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import NoReturn

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from tritonq.kernels import backend, batch_invariant
from tritonq.kernels.cpu import lowbit as cpu_lowbit
from tritonq.kernels.common import (
    WeightGemm,
    GemmPlan,
    Launch,
    gemm_output,
    half_bit_tricks,
    int4_word_dequant,
    int8_word_dequant,
    int8_words_minus_zero,
    code_pairs_lookup,
    next_pow2,
    split_k_arrivals,
    check_launch_config,
    compute_capability,
    config_rows,
    int4_words_minus_zero,
    dequantize_int_tile,
    add_rms_norm_tile,
    reduce_split_k,
    silu_mul_pairs,
    store_output,
    tune_group_size,
    tuned_or_default,
    unpack_int_tile,
    upcast_dot,
)
from tritonq.quant.packing import pack_int32, unpack_int32
from tritonq.quant.weights import Int4Weight

SPLIT_K_MAX_M = 16  # M at or below which the split-K (decode) path runs

# Values a tuner may sweep; every combination is a valid Int4GemmConfig.
CONFIG_SPACE = {
    "BLOCK_M": [16, 32, 64, 128],
    "BLOCK_N": [32, 64, 128, 256],
    "BLOCK_K": [32, 64, 128],
    "SPLIT_K": [1, 2, 4, 8, 16],
    "num_warps": [2, 4, 8],
    "num_stages": [2, 3, 4, 5],
}


@dataclass(frozen=True)
class Int4GemmConfig:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _int4_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, TILE_GROUPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr, WORD_DEQUANT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    code_ptr, HAS_CODE: tl.constexpr, partials_ptr, arrivals_ptr, SILU_MUL: tl.constexpr,
    x_perm_ptr, PERMUTE_X: tl.constexpr, CODE_PAIRS: tl.constexpr, EVEN_K: tl.constexpr,
    res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr, eps, ADD_NORM: tl.constexpr,
):
    """One program: a [BLOCK_M, BLOCK_N] output tile over K slice pid_k (of SPLIT_K).

    out is [M, N] in x's dtype ([M, N / 2] with SILU_MUL: silu(gate) * up of the column pairs,
    `common.store_output`; ADD_NORM: out = y + residual and h its RMSNorm, `common.add_rms_norm_tile`). With
    SPLIT_K > 1 the slices meet in `common.reduce_split_k` (fp32 partials [SPLIT_K, M, N], an int32 arrival count
    per output tile), in this launch. PERMUTE_X: the weight's K rows are sorted by group (`sort_act_order`) and
    x's columns are read through the same permutation, x_perm [K]. EVEN_K: K is whole BLOCK_K tiles (the loop's
    loads need no K mask; the launcher sets it for the packed-word paths).
    """
    PER_WORD: tl.constexpr = 32 // BITS
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)  # row x stride reaches 2^31 elements for M * K or M * N >= 2^31 (long prefills)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if CODE_PAIRS:  # the 256-entry pair table, loaded once: the loop's lookups gather from it (code_pairs_lookup)
        pairs = tl.load(code_ptr + tl.arange(0, 256))

    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = (offs_k < K) | EVEN_K  # EVEN_K: whole K tiles, the loads' K masks fold away
        x_cols = offs_k
        if PERMUTE_X:
            x_cols = tl.load(x_perm_ptr + offs_k, mask=mask_k, other=0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + x_cols[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        offs_word = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
        words = tl.load(qweight_ptr + offs_word[:, None] * N + offs_n[None, :],
                        mask=((offs_word < K // PER_WORD) | EVEN_K)[:, None] & mask_n[None, :], other=0)
        q = words  # the word path reads the words themselves; else unpacked right after the load (unpack_int_tile)
        if not (WORD_DEQUANT or CODE_PAIRS):
            q = unpack_int_tile(words, BITS)
        mask_kn = mask_k[:, None] & mask_n[None, :]
        if TILE_GROUPS:  # the whole K tile lies in group k0 // group_size
            g = k0 // group_size
            s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0)[None, :]
            z = s  # read only with HAS_ZEROS
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g * N + offs_n, mask=mask_n, other=0.0)[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
            else:
                g = offs_k // group_size
            s = tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0)
            z = s
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0)
        if CODE_PAIRS:  # code table values by pairs of codes, the block absmax on the dot's fp32 result
            acc += tl.dot(x, code_pairs_lookup(q, pairs, x.dtype)) * s
        elif WORD_DEQUANT:  # codes from the packed words by bit tricks (common.int4_words_to_magic, int8_...)
            if BITS == 4:
                t = int4_words_minus_zero(q, z, HAS_ZEROS, x.dtype)
            else:
                t = int8_words_minus_zero(q, z, HAS_ZEROS, x.dtype)
            if TILE_GROUPS and BLOCK_M < BLOCK_K:  # one scale per column for the tile: fewer multiplies on the
                acc += tl.dot(x, t) * s.to(tl.float32)  # dot's fp32 result (BLOCK_M rows) than per weight
            else:
                acc = tl.dot(x, (t * s).to(x.dtype), acc)
        else:
            if HAS_CODE:  # bitsandbytes nf4 / fp4: q indexes a 16-entry code table, s is the block's absmax
                w = (tl.load(code_ptr + q) * s.to(tl.float32)).to(x.dtype)
            else:  # weights meet the activations in x's dtype, as on the tensor cores
                w = dequantize_int_tile(q, s, z, BITS, HAS_ZEROS, x.dtype)
            if UPCAST_DOT:  # fp32 x (exact ieee dot), or bf16 under the interpreter (common.upcast_dot)
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)

    if HAS_BIAS:  # added once: by the first K slice only
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    last = True
    if SPLIT_K > 1:
        acc, last = reduce_split_k(acc, partials_ptr, arrivals_ptr, pid_m * tl.num_programs(1) + pid_n, pid_k, rows,
                                   offs_n, mask_m, mask_n, M, N, SPLIT_K)
    if last:
        if ADD_NORM:
            add_rms_norm_tile(out_ptr, acc, rows, offs_n, mask_m, M, N, res_ptr, norm_w_ptr, h_ptr, sumsq_ptr,
                              row_arrivals_ptr, pid_m, pid_n, eps)
        else:
            store_output(out_ptr, acc, rows, offs_n, mask_m, N, N // 2 if SILU_MUL else N, SILU_MUL)


def default_config(M: int, N: int, K: int, act_order: bool = False, cc: int | None = None) -> Int4GemmConfig:
    """Defaults in code, used when no tuned JSON entry exists for this GPU and shape. act_order (a g_idx that
    `sort_act_order` cannot sort: scales and zeros gathered per row, a tile of them in registers) and sm_75 (`cc`,
    None: sm_80+; dots on FMA) take half the decode tile, which spills otherwise."""
    small = act_order or (cc is not None and cc < 80)
    if M <= SPLIT_K_MAX_M:
        block_n, block_k = (64 if small else 128), 128
        n_tiles = triton.cdiv(N, block_n)
        k_tiles = triton.cdiv(K, block_k)
        # Aim for ~2 waves on a 132-SM GPU while keeping >= 2 K tiles per slice. 128 x 128 over 2 warps: 256 weights
        # per thread and iteration, over which the loop's address and loop arithmetic spread (docs/gpu_kernels.md);
        # sm_86 / sm_89 take 4 warps (2 spill 8 bytes there).
        split_k = max(1, min(16, next_pow2(triton.cdiv(264, n_tiles)), k_tiles // 2))
        if small:
            return Int4GemmConfig(16, block_n, block_k, split_k, num_warps=4, num_stages=4)
        return Int4GemmConfig(16, block_n, block_k, split_k, num_warps=4 if cc in (86, 89) else 2, num_stages=3)
    if M <= 64:
        return Int4GemmConfig(max(16, next_pow2(M)), 64, 64, 1, num_warps=4, num_stages=4)
    return Int4GemmConfig(128, 128, 64, 1, num_warps=8, num_stages=3)


def config_bucket(M: int, N: int, K: int, w: Int4Weight) -> str:
    """Key of the tuned-config JSON: M rounded up to a power of two; exact N, K, group size, bits."""
    return f"M{next_pow2(M)}_N{N}_K{K}_G{w.group_size}_B{w.bits}"


def _fail(name: str, found, expected: str, fix: str) -> NoReturn:
    raise ValueError(f"int4_gemm: {name} is {found}, expected {expected}; {fix}")


def _check_weight(w: Int4Weight) -> tuple[int, int]:
    """Validate an Int4Weight's tensors; returns (N, K)."""
    if not isinstance(w, Int4Weight):
        _fail("w", type(w).__name__, "Int4Weight", "load it through a tritonq.formats loader")
    if w.bits not in (4, 8):
        _fail("bits", w.bits, "4 or 8", "only 4-bit (AWQ/GPTQ) and 8-bit (GPTQ) weights are supported")
    q = w.qweight
    if q.dtype != torch.int32 or q.dim() != 2:
        _fail("qweight", f"{q.dtype} of shape {tuple(q.shape)}", "int32 [K*bits/32, N]",
              "pack with tritonq.quant.packing.pack_int32")
    N, K = w.shape
    if w.group_size <= 0 or K % w.group_size:
        _fail("group_size", w.group_size, f"a positive divisor of K={K}", "use K for per-channel quantization")
    s = w.scales
    if s.dtype not in (torch.float16, torch.bfloat16, torch.float32) or s.dim() != 2 or s.shape[1] != N:
        _fail("scales", f"{s.dtype} of shape {tuple(s.shape)}", f"fp16/bf16/fp32 [G, {N}]",
              "scales are one row per group")
    if w.g_idx is None and s.shape[0] != K // w.group_size:
        _fail("scales", f"of shape {tuple(s.shape)}", f"[{K // w.group_size}, {N}] (K / group_size rows)",
              "check group_size")
    if w.zeros is not None and (w.zeros.shape != s.shape or w.zeros.dtype != s.dtype):
        _fail("zeros", f"{w.zeros.dtype} of shape {tuple(w.zeros.shape)}", f"{s.dtype} {tuple(s.shape)} like scales",
              "unpack zeros to floats in the scales' dtype")
    if w.g_idx is not None and (w.g_idx.dtype != torch.int32 or tuple(w.g_idx.shape) != (K,)):
        _fail("g_idx", f"{w.g_idx.dtype} of shape {tuple(w.g_idx.shape)}", f"int32 [{K}]",
              "g_idx holds the group of each input row")
    if w.perm is not None and (w.perm.dtype != torch.int32 or tuple(w.perm.shape) != (K,) or w.g_idx is not None):
        _fail("perm", f"{w.perm.dtype} of shape {tuple(w.perm.shape)} (g_idx set: {w.g_idx is not None})",
              f"int32 [{K}] with no g_idx", "make it with sort_act_order")
    if w.code is not None and (w.code.dtype != torch.float32 or tuple(w.code.shape) != (16,) or w.bits != 4
                               or w.zeros is not None or w.g_idx is not None):
        _fail("code", f"{w.code.dtype} of shape {tuple(w.code.shape)} (bits={w.bits}, zeros/g_idx set: "
              f"{w.zeros is not None}/{w.g_idx is not None})", "fp32 [16] with bits 4 and no zeros or g_idx",
              "a code table indexes 4-bit codes times a block absmax (formats/bitsandbytes.py)")
    if w.bias is not None and tuple(w.bias.shape) != (N,):
        _fail("bias", f"of shape {tuple(w.bias.shape)}", f"[{N}]", "one bias per output")
    for name in ("qweight", "scales", "zeros", "g_idx", "bias", "code", "perm"):  # the kernel indexes them densely
        t = getattr(w, name)
        if t is not None and not t.is_contiguous():
            _fail(name, f"non-contiguous with strides {t.stride()}", "a contiguous tensor",
                  "call .contiguous() at load")
    return N, K


def int4_gemm(x: torch.Tensor, w: Int4Weight, config: Int4GemmConfig | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(w)^T (+ w.bias), in x.dtype. `config` overrides the lookup (tune, tests);
    without one the call runs through the weight's `Int4Gemm`, built once per weight object."""
    if config is not None:
        return Int4Gemm(w)(x, config)
    gemm = _gemms.get(w)
    if gemm is None:
        gemm = _gemms[w] = Int4Gemm(w)
    return gemm(x)


class Int4Gemm(WeightGemm):
    """int4_gemm over one weight, checked once here (`_check_weight`; off CUDA also its g_idx values). Per
    (M bucket, x dtype) the config, grid and launch arguments are resolved once (`GemmPlan`); a call checks
    x, picks the backend and runs one launch (the split-K sum and cast inside it, `common.reduce_split_k`). The Triton
    path of an act-order weight runs it sorted by group (`sort_act_order`, here: one device sync; the sorted weight
    replaces the given one as `self.w`, which `kernels.linear` hands to the Linear, so the codes are held once).
    silu_mul: w's rows are (gate, up) pairs and a call returns silu(gate) * up [M, N / 2], SwiGLU in the epilogue
    (`kernels.linear.prepare_gate_up`); the CPU and reference paths apply `common.silu_mul_pairs` after the GEMM."""

    def __init__(self, w: Int4Weight, silu_mul: bool = False):
        self.N, self.K = _check_weight(w)
        if silu_mul and self.N % 2:
            _fail("N", self.N, "even for silu_mul (gate, up pairs)", "fuse the gate and up weights first")
        self.silu_mul = silu_mul
        if not w.qweight.is_cuda:  # interpreter; CUDA relies on the load-time check in gptq_to_int4 (no sync)
            w.check_g_idx()
        sorted_w = sort_act_order(w) if backend(w.qweight) == "triton" else None
        if sorted_w is not None:  # held here too (WeightGemm holds weakly; nothing else holds it for a bare call)
            w = self.sorted_w = sorted_w
        super().__init__(w)
        self.device, self.plans = w.qweight.device, {}
        # the CPU backend's form of the weight, made once here (a compiled step reads it as an attribute)
        self.cpu = cpu_lowbit.prepare(w) if backend(w.qweight) == "cpu" else None

    def __call__(self, x: torch.Tensor, config: Int4GemmConfig | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.K or x.dtype not in _X_DTYPES:
            _fail("x", f"{x.dtype} of shape {tuple(x.shape)}", f"fp16/bf16/fp32 [M, {self.K}]",
                  "flatten leading dims to M first")
        if x.device != self.device:
            _fail("x", f"on {x.device}", f"on the weight's device {self.device}", "move x or the weight")
        b = backend(x)
        if b != "triton":  # torch's CPU kernel over the weight prepared once (kernels/cpu/lowbit.py), or the oracle
            if b == "cpu":
                y = cpu_lowbit.linear(x, self.cpu if self.cpu is not None else cpu_lowbit.prepare(self.w))
            else:
                y = int4_gemm_reference(x, self.w)
            return silu_mul_pairs(y) if self.silu_mul else y
        M = x.shape[0]
        w = self.w
        if config is not None:
            plan = _plan(x, w, config, M, self.silu_mul)
        else:
            key = (next_pow2(M), x.dtype, batch_invariant())
            plan = self.plans.get(key)
            if plan is None:
                rows = config_rows(M)  # M, or one row count for every M in the batch-invariant mode
                config = tuned_or_default("int4_gemm", config_bucket(rows, self.N, self.K, w),
                                          default_config(rows, self.N, self.K, w.g_idx is not None,
                                                         compute_capability(self.device)))
                plan = self.plans[key] = _plan(x, w, config, key[0], self.silu_mul)
        return plan.run(M, x.dtype, self.device, x_ptr=x, stride_xm=x.stride(0), stride_xk=x.stride(1))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(y = x @ W^T + residual, RMSNorm(y) * norm_weight) [M, N] in one launch (`common.add_rms_norm_tile`):
        a decode step's o_proj with the residual addition and the post-attention norm in its epilogue. None where
        that launch does not run (`WeightGemm.fuses_add_norm`: the CPU and torch backends, M > SPLIT_K_MAX_M, the
        batch-invariant mode): the caller runs the GEMM and norm_rope.add_rms_norm."""
        if not self.fuses_add_norm(x, residual, norm_weight):
            return None
        M = x.shape[0]
        key = (next_pow2(M), x.dtype, "add_rms_norm")
        plan = self.plans.get(key)
        if plan is None:
            w = self.w
            config = tuned_or_default("int4_gemm", config_bucket(M, self.N, self.K, w),
                                      default_config(M, self.N, self.K, w.g_idx is not None,
                                                     compute_capability(self.device)))
            plan = self.plans[key] = _plan(x, w, config, key[0], False, add_norm=True)
        return plan.run_add_norm(M, residual, norm_weight, eps, x_ptr=x, stride_xm=x.stride(0),
                                 stride_xk=x.stride(1))


_X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_gemms: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Int4Weight -> its Int4Gemm (int4_gemm without a Linear)


def _plan(x: torch.Tensor, w: Int4Weight, config: Int4GemmConfig, max_m: int, silu_mul: bool,
          add_norm: bool = False) -> GemmPlan:
    """The GemmPlan of `int4_gemm_launch` for activations like x, at most max_m rows; add_norm: with the residual
    + RMSNorm epilogue (`GemmPlan.run_add_norm`)."""
    check_launch_config("int4_gemm", config, Int4GemmConfig)
    N = w.shape[0]
    launch = int4_gemm_launch(x, w, config, split_k_arrivals(max_m, N, config, x.device), silu_mul)[0]
    return GemmPlan(launch, "out_ptr", ("x_ptr", "stride_xm", "stride_xk"), N, config.BLOCK_M,
                    triton.cdiv(N, config.BLOCK_N), config.SPLIT_K, flat=False, silu_mul=silu_mul,
                    add_norm_rows=max_m if add_norm else 0)


def int4_gemm_launch(x: torch.Tensor, w: Int4Weight, config: Int4GemmConfig, arrivals: torch.Tensor | None = None,
                     silu_mul: bool = False, cc: int | None = None) -> tuple[Launch, torch.Tensor]:
    """The launch of _int4_gemm_kernel for x [M, K] @ w (both checked by the caller) with `config`, and its
    output y [M, N] in x.dtype (silu_mul: [M, N / 2], SwiGLU of the column pairs in the epilogue). With SPLIT_K > 1
    it takes the fp32 [SPLIT_K, M, N] partials buffer and
    `arrivals`, the zeroed int32 count per output tile that the slices share (made here when None). Over
    meta tensors it is what tune --aot and tests/aot/test_fit.py compile, for sm_`cc` (`common.int4_word_dequant`).
    A weight with perm (`sort_act_order`) has x's columns read through it."""
    (M, K), N = x.shape, w.shape[0]
    block_k = config.BLOCK_K
    if w.g_idx is None and w.group_size % block_k:
        # A tile must not straddle two groups for TILE_GROUPS; shrink BLOCK_K to fit if it can.
        block_k = max(math.gcd(block_k, w.group_size), 16)
    split_k = config.SPLIT_K
    out, partials, arrivals = gemm_output(M, N, config, x.dtype, x.device, arrivals, silu_mul)
    tile_groups = w.g_idx is None and w.group_size % block_k == 0
    # a code table by pairs where the tile has one absmax row and fewer rows than BLOCK_K (decode)
    code_pairs = w.code is not None and tile_groups and config.BLOCK_M < block_k and half_bit_tricks(x, cc)
    word_dequant = int4_word_dequant(x, w, cc) or int8_word_dequant(x, w, cc)
    # the packed-word loops drop their K masks where K is whole tiles; the per-element loops keep them (without, sm_75's
    # and sm_80's nf4 prefill tiles, already at 255 registers, spill more)
    even_k = K % block_k == 0 and (word_dequant or code_pairs)
    args = dict(
        x_ptr=x, qweight_ptr=w.qweight, scales_ptr=w.scales, zeros_ptr=w.zeros if w.zeros is not None else w.scales,
        g_idx_ptr=w.g_idx if w.g_idx is not None else w.qweight, bias_ptr=w.bias if w.bias is not None else w.scales,
        out_ptr=out, M=M, N=N, K=K, group_size=w.group_size, stride_xm=x.stride(0), stride_xk=x.stride(1),
        BITS=w.bits, HAS_ZEROS=w.zeros is not None, HAS_G_IDX=w.g_idx is not None,
        TILE_GROUPS=tile_groups, HAS_BIAS=w.bias is not None,
        UPCAST_DOT=upcast_dot(x), WORD_DEQUANT=word_dequant,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=block_k, SPLIT_K=split_k,
        code_ptr=code_pair_table(w.code, x.dtype) if code_pairs else w.code if w.code is not None else w.scales,
        HAS_CODE=w.code is not None, CODE_PAIRS=code_pairs, EVEN_K=even_k,
        partials_ptr=partials, arrivals_ptr=arrivals, SILU_MUL=silu_mul,
        x_perm_ptr=w.perm if w.perm is not None else w.qweight, PERMUTE_X=w.perm is not None,
        # the residual + RMSNorm epilogue's tensors (GemmPlan's add_norm binds them); unused without ADD_NORM
        res_ptr=out, norm_w_ptr=out, h_ptr=out, sumsq_ptr=partials, row_arrivals_ptr=out, eps=0.0, ADD_NORM=False)
    grid = (triton.cdiv(M, config.BLOCK_M), triton.cdiv(N, config.BLOCK_N), split_k)
    return Launch(_int4_gemm_kernel, grid, args, config.num_warps, config.num_stages), out


def code_pair_table(code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 [256]: entry b holds {code[b & 15], code[b >> 4]} in dtype, low half first (`common.code_pairs_lookup`)."""
    if code.is_meta:
        return torch.empty(256, dtype=torch.int32, device=code.device)
    h = code.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    b = torch.arange(256, device=code.device)
    pairs = h[b & 15] | h[b >> 4] << 16
    return (pairs - (pairs >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def sort_act_order(w: Int4Weight) -> Int4Weight | None:
    """An act-order weight (g_idx) with its K rows sorted by group, the permutation in its perm (int32 [K]): row j of
    the sorted weight is row perm[j] of w, so x[:, perm] @ sorted^T has the products of x @ w^T (summed in another
    order). Groups become contiguous runs of group_size rows as in plain GPTQ, so the kernel loads one scale row per
    K tile instead of gathering them per row. None without a g_idx, or where the sorted groups are not such runs.
    qweight is copied (repacked on its device, a block of columns at a time: the unpacked codes are int64)."""
    if w.g_idx is None:
        return None
    K, device = w.shape[1], w.qweight.device
    if w.g_idx.is_meta:  # a dry run (meta tensors: shapes, no values) takes the sorted form
        return replace(w, qweight=torch.empty_like(w.qweight), g_idx=None, perm=torch.empty_like(w.g_idx))
    perm = torch.argsort(w.g_idx, stable=True)
    if not torch.equal(w.g_idx[perm].long(), torch.arange(K, device=device) // w.group_size):
        return None
    qweight = torch.empty_like(w.qweight)
    for n0 in range(0, w.shape[0], SORT_COLUMNS):
        block = w.qweight[:, n0:n0 + SORT_COLUMNS]
        qweight[:, n0:n0 + SORT_COLUMNS] = pack_int32(unpack_int32(block, w.bits, dim=0)[perm], w.bits, dim=0)
    return replace(w, qweight=qweight, g_idx=None, perm=perm.to(torch.int32))


SORT_COLUMNS = 1024  # columns per block of sort_act_order's repacking


def int4_gemm_reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """Plain torch: unpack -> dequant -> fp32 matmul (+ bias) -> x.dtype. The oracle (TRITONQ_BACKEND=torch)."""
    _check_weight(w)
    y = x.float() @ w.dequantize().float().t()
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Tuning (python -m tritonq.tune --kernel int4_gemm): shapes MxNxK
# ----------------------------------------------------------------------------------------------

def sweep_space(shape: tuple[int, int, int]) -> list[dict]:
    """CONFIG_SPACE restricted to what is legal and useful for shape (M, N, K): the decode path
    (M <= SPLIT_K_MAX_M) uses BLOCK_M 16 with split-K, larger M no split-K and BLOCK_M <= M;
    BLOCK_K divides the group size (else the launcher shrinks it) and fits K with its split."""
    M, N, K = shape
    s = CONFIG_SPACE
    small = M <= SPLIT_K_MAX_M
    out = []
    for bm, bn, bk, sk, warps, stages in itertools.product(
            s["BLOCK_M"], s["BLOCK_N"], s["BLOCK_K"], s["SPLIT_K"], s["num_warps"], s["num_stages"]):
        if (bm != 16 if small else (sk != 1 or bm > max(16, triton.next_power_of_2(M)))):
            continue
        if tune_group_size(K) % bk or bk * sk > K or bn > max(32, triton.next_power_of_2(N)):
            continue
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=warps, num_stages=stages))
    return out


def aot_launch(config: Int4GemmConfig, M: int, N: int, K: int, dtype: torch.dtype = torch.float16, bits: int = 4,
               zeros: bool = True, act_order: bool | str = False, code: bool = False, cc: int = 90) -> Launch:
    """`int4_gemm_launch` over meta tensors: x [M, K] in dtype, an N x K weight of `bits` with group
    `tune_group_size(K)`, asymmetric (zeros) or not, act-order or not (True: sorted by `sort_act_order`, x read
    through the permutation; "gather": a g_idx whose groups do not sort into runs), no bias; code: a
    bitsandbytes nf4 weight (code table, fp32 absmax per 64-row block, no zeros); for sm_`cc`."""
    group_size = 64 if code else tune_group_size(K)
    meta = torch.device("meta")
    scales = torch.empty(K // group_size, N, dtype=torch.float32 if code else dtype, device=meta)
    w = Int4Weight(qweight=torch.empty(K * bits // 32, N, dtype=torch.int32, device=meta), scales=scales,
                   zeros=torch.empty_like(scales) if zeros and not code else None,
                   g_idx=torch.empty(K, dtype=torch.int32, device=meta) if act_order == "gather" else None,
                   group_size=group_size, bits=bits,
                   code=torch.empty(16, dtype=torch.float32, device=meta) if code else None,
                   perm=torch.empty(K, dtype=torch.int32, device=meta) if act_order is True else None)
    return int4_gemm_launch(torch.empty(M, K, dtype=dtype, device=meta), w, config, cc=cc)[0]
