"""FP8 GEMM: y [M, N] = x [M, K] @ W^T for float8_e4m3fn weights W [N, K] with fp32 scales.

Weight scales (FP8Weight.weight_scale, W = weight * scale):
  per tensor  []                                  one scale
  per channel [N, 1]                              one scale per output row
  block       [ceil(N/bn), ceil(K/bk)], block_size=(bn, bk) (DeepSeek-V3 `weight_scale_inv`)
Activations are quantized to e4m3 dynamically per token (one scale per row of x), per 1 x bk group for block
weights, or statically with FP8Weight.input_scale. Scale = absmax / 448, values clamped to +-448 before the cast.
Up to QUANTIZE_IN_GEMM_MAX_M rows (decode) the GEMM kernel quantizes the tiles it reads itself (each program
reads its rows' absmax over all of K, or over the tile's group: x is a few KB there; only the M bucket's rows,
`common.broadcast_rows`), so a linear is one launch;
above, `quantize_activation_fp8` (a Triton kernel) writes the e4m3 activations first. Both give the same numbers.

Two kernel paths, one @triton.jit kernel:
  fp8 x fp8 (sm_89+): tl.dot on e4m3 operands, fp32 accumulator; block-scaled weights apply
      a_scale * w_scale after every K tile (the tile never straddles a scale block), per-tensor
      and per-channel weights apply them once in the epilogue.
  weight-only (below sm_89, where Triton has no e4m3): x stays fp16/bf16/fp32 and the weight bytes
      are turned into fp16 with integer ops (exact, see `common.e4m3_bits_to_fp16`; from sm_80 in fp16 / bf16
      4 bytes a word by inline PTX, `common.e4m3_words_to_halves`), then tl.dot
      in x.dtype (fp32 in IEEE fp32, `common.ieee_dot`).
Decode-sized M splits K across programs (SPLIT_K) so that enough programs stream the weight; each
K slice writes its fp32 partial into its own plane of a [SPLIT_K, M, N] buffer and the last slice
to finish sums them in slice order in the same launch (`common.reduce_split_k`), as int4_gemm does:
deterministic (fp32 atomics add in whatever order the slices finish) and the buffer is tiny at decode M.
Launch configs come from kernels/configs/fp8_gemm*/<gpu>.json when tuned (`common.tuned_or_default`),
else `default_config`, looked up once per (weight, M bucket, path) by the weight's `FP8Gemm`;
`fp8_gemm_launch` builds every launch (the plans', and tune --aot's over meta tensors); `sweep_space` is what
`python -m tritonq.tune --kernel fp8_gemm` sweeps (tune/targets.py).
fp32 accumulation throughout; output in x.dtype, plus bias. CPU tensors (no interpreter) run
weight-only by default, like GPUs below sm_89: fp32 activations times the weight dequantized once
to fp32 (kernels/cpu/lowbit.py). `fp8_gemm_reference` (TRITONQ_BACKEND=torch, float32) is the
oracle; it quantizes activations unless weight_only=True.
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from tritonq.kernels import backend, batch_invariant
from tritonq.kernels.cpu import lowbit as cpu_lowbit
from tritonq.kernels.common import (WeightGemm, E4M3_TO_FP16_BIAS, INTERPRETED, QUANTIZE_IN_GEMM_MAX_M, GemmConfig,
    GemmPlan, Launch, activation_rows, activation_scale, broadcast_rows, check_gemm_activations, check_gemm_weight,
    check_launch_config, compute_capability, config_rows, decode_split_k, divide_by_scale, e4m3_bits_to_fp16, e4m3_words_to_halves,
    gemm_grid, gemm_output, gemm_tile, half_bit_tricks, has_fp8_tensor_cores, ieee_dot, quant_rows, round_to_e4m3,
    next_pow2, rows_absmax, silu_mul_pairs, split_k_arrivals, store_gemm_tile, tuned_or_default)
from tritonq.kernels.common import gemm_config_bucket as config_bucket
from tritonq.quant.weights import FP8Weight

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_EPS = 1e-10  # floor on absmax so all-zero rows get a finite scale (and quantize to 0)
_FP8_MAX = tl.constexpr(FP8_MAX)  # the same numbers as seen from inside @triton.jit
_SCALE_EPS = tl.constexpr(SCALE_EPS)

# Values the tuner sweeps (the fields of FP8GemmConfig; `sweep_space` keeps those legal for a
# shape). BLOCK_K 64/128 divide the 128-wide scale blocks, so every winner is valid for block weights
# too; with other block scales BLOCK_K must divide the K block, which the launcher checks.
CONFIG_SPACE = {
    "BLOCK_M": [16, 32, 64, 128],
    "BLOCK_N": [32, 64, 128, 256],
    "BLOCK_K": [64, 128],
    "GROUP_M": [1, 8],
    "SPLIT_K": [1, 2, 4, 8, 16],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4, 5],
}


class FP8GemmConfig(GemmConfig):
    """Launch config of _fp8_gemm_kernel (the fields of `common.GemmConfig`). With block scales BLOCK_K must
    divide the K block."""


@triton.jit
def _quantize_activation_kernel(x_ptr, q_ptr, s_ptr, static_scale_ptr, K, stride_xm, stride_qm,
                                stride_sm, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                                STATIC: tl.constexpr):
    """One program per (row, group of GROUP columns): absmax -> scale -> clamp -> e4m3."""
    row = tl.program_id(0).to(tl.int64)  # row x stride: past 2^31 elements for M * K >= 2^31
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (offs < K) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = activation_scale(x, static_scale_ptr, STATIC, _FP8_MAX, _SCALE_EPS)
    if not STATIC:
        tl.store(s_ptr + row * stride_sm + group, scale)
    tl.store(q_ptr + row * stride_qm + offs, _quantize_fp8(x, scale), mask=mask)


@triton.jit
def _fp8_scale(absmax):
    """Per-row scales [BLOCK_M, 1] from the rows' absmax [BLOCK_M] (floored at SCALE_EPS), as
    `activation_scale` computes them: IEEE division (div_rn), like the torch reference."""
    absmax = tl.maximum(absmax, _SCALE_EPS)
    return tl.math.div_rn(absmax, tl.zeros_like(absmax) + _FP8_MAX)[:, None]


@triton.jit
def _quantize_fp8(x, scale):
    """fp32 x / scale (a scalar, or broadcasting against x) -> e4m3, rounded to nearest even, out-of-range values
    saturated at +-448. The division rounds as IEEE division does (`divide_by_scale`), like the torch reference (plain
    `/` is an approximate division on NVIDIA). The GPU's cast is one cvt.rn.satfinite per pair, which rounds and
    saturates so; the interpreter's cast does neither right, so there the clamp and `round_to_e4m3` come first."""
    q = divide_by_scale(x, scale)
    if INTERPRETED:
        q = round_to_e4m3(tl.clamp(q, -_FP8_MAX, _FP8_MAX))
    return q.to(tl.float8e4nv)


@triton.jit
def _rows_scale(a_scale, STATIC_A: tl.constexpr, BLOCK_M: tl.constexpr):
    """The in-kernel activation scale against the dot's [BLOCK_M, BLOCK_N] result: the static scalar as it is, the
    QUANT_ROWS rows' [QUANT_ROWS, 1] scales copied up to BLOCK_M rows as the activations were (`broadcast_rows`)."""
    if STATIC_A:
        return a_scale
    return broadcast_rows(a_scale, BLOCK_M)


@triton.jit
def _fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, partials_ptr, arrivals_ptr, M, N, K,
                     stride_am, stride_wn, stride_ym, stride_asm, stride_asg, stride_wsn, stride_wsk,
                     A_GROUP: tl.constexpr, W_SCALE_BN: tl.constexpr, W_SCALE_BK: tl.constexpr,
                     SCALE_PER_TILE: tl.constexpr, WEIGHT_ONLY: tl.constexpr, WORD_DECODE: tl.constexpr,
                     QUANTIZE_A: tl.constexpr,
                     STATIC_A: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, QUANT_ROWS: tl.constexpr,
                     res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr, eps, ADD_NORM: tl.constexpr):
    """y[M, N] = (a * a_scale) @ (w * w_scale)^T (+ bias); SILU_MUL: y [M, N / 2] = SwiGLU of the (gate, up) column
    pairs (`common.store_output`); ADD_NORM: y + residual and its RMSNorm h (`common.add_rms_norm_tile`).

    a: e4m3 [M, K] with a_scale [M, K/A_GROUP] fp32 (strides 0 where a scale is shared), or
    with WEIGHT_ONLY the fp16/bf16 activations themselves (a_scale unused). w: [N, K] e4m3, or
    its uint8 bytes with WEIGHT_ONLY, or with WORD_DECODE its int32 words [N, K / 4] (4 bytes along K each, decoded
    by `common.e4m3_words_to_halves`). w_scale[n // W_SCALE_BN, k // W_SCALE_BK].
    QUANTIZE_A (decode M): a is the fp16/bf16/fp32 activations, quantized here tile by tile exactly as
    `quantize_activation_fp8` does (its scales from `rows_absmax` over the row or the A_GROUP group, or the static
    one at a_scale_ptr with STATIC_A), so the GEMM is the linear's only launch. It quantizes QUANT_ROWS rows (the M
    bucket, `common.quant_rows`), not the dot's padding rows: at M = 1 one row per K tile.
    SPLIT_K > 1 (decode): program_id(1) takes one K slice; the slices' scaled partial sums meet in
    `common.reduce_split_k`, in this launch.
    """
    rows, offs_n, offs_k, mask_m, mask_n, k_start, k_end = gemm_tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                                                     SPLIT_K)
    a_rows, mask_a = activation_rows(rows, mask_m, M, QUANTIZE_A, QUANT_ROWS)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_start + offs_k)[None, :]
    offs_kw = tl.arange(0, BLOCK_K // 4)  # WORD_DECODE: the tile's words along K
    if WORD_DECODE:
        k_words = tl.multiple_of(k_start // 4, BLOCK_K // 4)  # k_start: whole K tiles (16-byte loads)
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_words + offs_kw)[:, None]  # [BLOCK_K / 4, BLOCK_N]
    else:
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (k_start + offs_k)[:, None]  # [BLOCK_K, BLOCK_N], K-major
    a_scale_ptrs = a_scale_ptr + rows * stride_asm
    w_scale_ptrs = w_scale_ptr + (offs_n // W_SCALE_BN) * stride_wsn

    x_rows = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # QUANTIZE_A: column 0 of the rows
    if QUANTIZE_A:
        if STATIC_A:
            a_scale = tl.load(a_scale_ptr)
        elif not SCALE_PER_TILE:  # per token: each program reads its rows' absmax over all of K
            a_scale = _fp8_scale(rows_absmax(x_rows, mask_a, 0, K, BLOCK_K))

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end - k0
        a = tl.load(a_ptrs, mask=mask_a[:, None] & mask_k[None, :], other=0.0)
        if WORD_DECODE:
            w = tl.load(w_ptrs, mask=(offs_kw < (k_end - k0) // 4)[:, None] & mask_n[None, :], other=0)
        else:
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if QUANTIZE_A:  # the QUANT_ROWS rows, then copied up to the dot's BLOCK_M
            a = a.to(tl.float32)
            if SCALE_PER_TILE and not STATIC_A:  # the 1 x A_GROUP group holding this tile (BLOCK_K divides it)
                if A_GROUP == BLOCK_K:
                    a_scale = _fp8_scale(tl.max(tl.abs(a), axis=1))
                else:
                    group_start = k0 // A_GROUP * A_GROUP
                    a_scale = _fp8_scale(rows_absmax(x_rows, mask_a, group_start, min(group_start + A_GROUP, K),
                                                     BLOCK_K))
            a = broadcast_rows(_quantize_fp8(a, a_scale), BLOCK_M)
        if WORD_DECODE:
            w = e4m3_words_to_halves(w, a.dtype)
        elif WEIGHT_ONLY:
            # via fp32: exact, and the interpreter's direct fp16 -> bf16 cast is wrong
            w = e4m3_bits_to_fp16(w).to(tl.float32).to(a.dtype)
        partial = ieee_dot(a, w, None)  # fp32 accumulator; fp32 x (weight-only) in IEEE fp32, not tf32
        if SCALE_PER_TILE:  # block scales: BLOCK_K divides W_SCALE_BK and A_GROUP
            w_scale = tl.load(w_scale_ptrs + (k0 // W_SCALE_BK) * stride_wsk, mask=mask_n, other=0.0)
            if WEIGHT_ONLY:
                acc += partial * w_scale[None, :]
            elif QUANTIZE_A:
                acc += partial * _rows_scale(a_scale, STATIC_A, BLOCK_M) * w_scale[None, :]
            else:
                a_scale = tl.load(a_scale_ptrs + (k0 // A_GROUP) * stride_asg, mask=mask_m, other=0.0)
                acc += partial * a_scale[:, None] * w_scale[None, :]
        else:
            acc += partial
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 4 if WORD_DECODE else BLOCK_K

    if not SCALE_PER_TILE:  # per-tensor / per-channel: scales are constant along K
        acc *= tl.load(w_scale_ptrs, mask=mask_n, other=0.0)[None, :]
        if QUANTIZE_A:
            acc *= _rows_scale(a_scale, STATIC_A, BLOCK_M)
        elif not WEIGHT_ONLY:
            acc *= tl.load(a_scale_ptrs, mask=mask_m, other=0.0)[:, None]
    if WEIGHT_ONLY:
        acc *= E4M3_TO_FP16_BIAS
    store_gemm_tile(y_ptr, acc, bias_ptr, partials_ptr, arrivals_ptr, rows, offs_n, mask_m, mask_n, stride_ym, M, N,
                    HAS_BIAS, SPLIT_K, SILU_MUL, res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr, eps, ADD_NORM)


def quantize_activation_fp8(x: torch.Tensor, group_size: int | None = None,
                            input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (x_fp8 [M, K] float8_e4m3fn, scales fp32), x ~= x_fp8 * scales.

    Dynamic per token (group_size None): scales [M, 1]; per 1 x group_size group: scales
    [M, ceil(K / group_size)]; static (input_scale, a one-element tensor): scales = input_scale.
    """
    _check_activation(x, group_size, input_scale)
    if backend(x) != "triton":
        return quantize_activation_fp8_reference(x, group_size, input_scale)
    x = x.contiguous()
    M, K = x.shape
    group = K if group_size is None or input_scale is not None else group_size
    n_groups = -(K // -group)  # ceil: plain ints (triton.cdiv costs ~10 us on the host)
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    if input_scale is not None:
        scales = input_scale.reshape(()).to(device=x.device, dtype=torch.float32)
    else:
        scales = torch.empty((M, n_groups), dtype=torch.float32, device=x.device)
    quantize_activation_launch(x, q, scales, group, static=input_scale is not None)()
    return q, scales


def quantize_activation_launch(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                               static: bool) -> Launch:
    """The launch of _quantize_activation_kernel: x [M, K] (contiguous) into q [M, K] e4m3 and scales
    ([M, K / group] fp32, or the static one-element scale), one program per (row, group). Over meta
    tensors it is what the AOT tests compile."""
    M, K = x.shape
    block = next_pow2(group)
    args = dict(x_ptr=x, q_ptr=q, s_ptr=scales, static_scale_ptr=scales, K=K, stride_xm=x.stride(0),
                stride_qm=q.stride(0), stride_sm=scales.stride(0) if scales.dim() else 0, GROUP=group, BLOCK=block,
                STATIC=static)
    return Launch(_quantize_activation_kernel, (M, -(K // -group)), args, max(1, min(8, block // 256)), 3)


def fp8_gemm(x: torch.Tensor, w: FP8Weight, weight_only: bool | None = None,
             config: FP8GemmConfig | None = None) -> torch.Tensor:
    """x [..., K] fp16/bf16/fp32 @ w [N, K] fp8 -> [..., N] in x.dtype (+ w.bias).

    weight_only None picks by weight and device: the weight-only path for a weight-only checkpoint
    (w.weight_only), below sm_89 (logged once) and on the CPU backend (no fp8 GEMM there either), else fp8
    tensor cores; True/False force a path (tests, benchmarks). config None: the tuned config for this shape
    if stored, else the defaults in `default_config`; without one the call runs through the weight's
    `FP8Gemm`, built once per weight object.
    """
    if config is not None:
        return FP8Gemm(w)(x, weight_only, config)
    gemm = _gemms.get(w)
    if gemm is None:
        gemm = _gemms[w] = FP8Gemm(w)
    return gemm(x, weight_only)


class FP8Gemm(WeightGemm):
    """fp8_gemm over one weight, checked once here; per (M bucket, x dtype, path) the config, grid and launch
    arguments are resolved once (`GemmPlan`). A call checks x, picks the backend and runs the GEMM: one launch
    (the split-K sum inside it, and up to QUANTIZE_IN_GEMM_MAX_M rows the activation quantization too); larger M
    quantize the activations in a launch of their own first. silu_mul: w's rows are (gate, up) pairs and a call
    returns silu(gate) * up [..., N / 2], SwiGLU in the epilogue (`kernels.linear.prepare_gate_up`)."""

    def __init__(self, w: FP8Weight, silu_mul: bool = False):
        _check_weight(w)
        super().__init__(w)
        self.device, self.plans = w.weight.device, {}
        self.N, self.K = w.shape
        self.silu_mul, self.out_cols = silu_mul, self.N // 2 if silu_mul else self.N
        self.scale_bk = w.block_size[1] if w.block_size is not None else None

    def __call__(self, x: torch.Tensor, weight_only: bool | None = None,
                 config: FP8GemmConfig | None = None) -> torch.Tensor:
        w, N, K = self.w, self.N, self.K
        check_gemm_activations("fp8_gemm", x, N, K, self.device)
        if weight_only is None and w.weight_only:  # a weight-only checkpoint never rounds activations, on any device
            weight_only = True
        lead = x.shape[:-1]
        x = x.reshape(-1, K)
        b = backend(x)
        if b == "cpu":  # weight dequantized once (kernels/cpu/lowbit.py); no fp8 GEMM: weight-only unless told
            xd = quantized_activations(x, w, weight_only is None or weight_only)
            return self._pairs(cpu_lowbit.linear(xd, cpu_lowbit.prepare(w)).to(x.dtype)).reshape(*lead, -1)
        if weight_only is None:
            weight_only = not has_fp8_tensor_cores(x.device)
        if b == "torch":
            return self._pairs(fp8_gemm_reference(x, w, weight_only)).reshape(*lead, -1)
        M = x.shape[0]
        x = x.contiguous()
        key = (next_pow2(M), x.dtype, weight_only, batch_invariant())
        plan = self.plans.get(key) if config is None else None
        if plan is None:
            plan = self._plan(x, weight_only, config, key[0])
            if config is None:
                self.plans[key] = plan
        if weight_only or key[0] <= QUANTIZE_IN_GEMM_MAX_M:  # x itself: not quantized, or quantized in the GEMM
            y = plan.run(M, x.dtype, self.device, a_ptr=x, stride_am=x.stride(0))
        else:
            a, a_scale = quantize_activation_fp8(x, self.scale_bk, w.input_scale)
            stride_asm, stride_asg = a_scale.stride() if a_scale.dim() else (0, 0)
            y = plan.run(M, x.dtype, self.device, a_ptr=a, a_scale_ptr=a_scale, stride_am=a.stride(0),
                         stride_asm=stride_asm, stride_asg=stride_asg)
        return y.reshape(*lead, self.out_cols)

    def _path(self, x: torch.Tensor) -> bool:
        """Whether activations like x run weight-only (`WeightGemm.add_rms_norm`'s kernel variant), as `__call__`
        decides it by default."""
        return self.w.weight_only or not has_fp8_tensor_cores(x.device)

    def _pairs(self, y: torch.Tensor) -> torch.Tensor:
        """The torch paths' output: y, or with silu_mul SwiGLU of its column pairs (the kernel's epilogue)."""
        return silu_mul_pairs(y) if self.silu_mul else y

    def _plan(self, x: torch.Tensor, weight_only: bool, config: FP8GemmConfig | None, max_m: int,
              add_norm: bool = False) -> GemmPlan:
        """The GemmPlan for activations like x (contiguous) on the path, at most max_m rows; add_norm (decode rows
        only): with the residual + RMSNorm epilogue (`GemmPlan.run_add_norm`)."""
        M, K = x.shape
        scale_bk = self.scale_bk
        cfg = config or tuned_config(M, self.N, K, weight_only, min(128, scale_bk or 128),
                                     compute_capability(x.device), scale_bk is not None)
        check_launch_config("fp8_gemm", cfg, FP8GemmConfig)
        if scale_bk is not None and scale_bk % cfg.BLOCK_K:
            raise ValueError(f"fp8_gemm: BLOCK_K={cfg.BLOCK_K} does not divide the weight's K block {scale_bk}; "
                             "a K tile must lie inside one scale block")
        arrivals = split_k_arrivals(max_m, self.N, cfg, x.device)
        if weight_only or max_m <= QUANTIZE_IN_GEMM_MAX_M:
            launch = fp8_gemm_launch(x, None, self.w, cfg, x.dtype, arrivals, not weight_only, self.silu_mul)[0]
            per_call = ("a_ptr", "stride_am")
        else:  # stand-ins for the quantized activations and their scales, bound per call
            a = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
            group = K if scale_bk is None or self.w.input_scale is not None else scale_bk
            a_scale = (torch.empty((M, triton.cdiv(K, group)), dtype=torch.float32, device=x.device)
                       if self.w.input_scale is None else torch.empty((), dtype=torch.float32, device=x.device))
            launch = fp8_gemm_launch(a, a_scale, self.w, cfg, x.dtype, arrivals, silu_mul=self.silu_mul)[0]
            per_call = ("a_ptr", "a_scale_ptr", "stride_am", "stride_asm", "stride_asg")
        return GemmPlan(launch, "y_ptr", per_call, self.N, cfg.BLOCK_M, triton.cdiv(self.N, cfg.BLOCK_N),
                        cfg.SPLIT_K, flat=True, silu_mul=self.silu_mul, add_norm_rows=max_m if add_norm else 0)


_gemms: WeakIdKeyDictionary = WeakIdKeyDictionary()  # FP8Weight -> its FP8Gemm (fp8_gemm without a Linear)


def fp8_gemm_launch(a: torch.Tensor, a_scale: torch.Tensor | None, w: FP8Weight, config: FP8GemmConfig,
                    out_dtype: torch.dtype, arrivals: torch.Tensor | None = None,
                    quantize: bool = False, silu_mul: bool = False, cc: int | None = None
                    ) -> tuple[Launch, torch.Tensor]:
    """The launch of _fp8_gemm_kernel and its output y [M, N] in out_dtype (silu_mul: [M, N / 2], SwiGLU of the
    column pairs in the epilogue; with SPLIT_K > 1 also the fp32 partials and `arrivals`, the split-K counts:
    `common.gemm_output`).

    a [M, K] contiguous: e4m3 activations with a_scale from `quantize_activation_fp8` ([] static,
    [M, 1] per token, [M, K / bk] per group), or the fp16/bf16 activations themselves with a_scale
    None (weight-only: the weight's bytes are decoded in the kernel, by words where `fp8_word_decode` says so; cc:
    the target of meta tensors, None: sm_80+). quantize: a is the fp16/bf16/fp32
    activations with a_scale None, quantized inside the GEMM (decode M; dynamically, or by w.input_scale), with
    the numbers of `quantize_activation_fp8`. The caller has checked config
    (with block scales BLOCK_K divides the K block). Over meta tensors this is what tune --aot compiles.
    """
    (M, K), N = a.shape, w.shape[0]
    weight_only = a_scale is None and not quantize
    weight = w.weight.contiguous()
    stride_wsn, stride_wsk, scale_bn, scale_bk = _weight_scale_layout(w)
    w_scale = w.weight_scale.to(torch.float32)
    static = w.input_scale is not None
    if quantize:  # the kernel's own scales, or the static one at a_scale_ptr
        a_scale = w.input_scale.reshape(()).to(torch.float32) if static else w_scale
        a_group, stride_asm, stride_asg = scale_bk if w.block_size is not None else K, 0, 0
    elif weight_only:
        a_scale, a_group, stride_asm, stride_asg = w_scale, K, 0, 0  # a_scale unused
        # decoded with integer ops, no fp8 type needed
        weight = weight.view(torch.int32 if fp8_word_decode(a, weight, cc) else torch.uint8)
    else:
        a_group = scale_bk if w.block_size is not None else K
        # a static scale is shared by every row and group
        stride_asm, stride_asg = a_scale.stride() if a_scale.dim() else (0, 0)
    y, partials, arrivals = gemm_output(M, N, config, out_dtype, a.device, arrivals, silu_mul)
    args = dict(a_ptr=a, a_scale_ptr=a_scale, w_ptr=weight, w_scale_ptr=w_scale,
                bias_ptr=w.bias if w.bias is not None else w_scale, y_ptr=y, partials_ptr=partials,
                arrivals_ptr=arrivals, M=M, N=N, K=K,
                stride_am=a.stride(0), stride_wn=weight.stride(0), stride_ym=y.stride(0), stride_asm=stride_asm,
                stride_asg=stride_asg, stride_wsn=stride_wsn, stride_wsk=stride_wsk,
                A_GROUP=a_group, W_SCALE_BN=scale_bn, W_SCALE_BK=scale_bk,
                SCALE_PER_TILE=w.block_size is not None, WEIGHT_ONLY=weight_only,
                WORD_DECODE=weight.dtype == torch.int32, QUANTIZE_A=quantize,
                STATIC_A=quantize and static, HAS_BIAS=w.bias is not None,
                BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, GROUP_M=config.GROUP_M,
                SPLIT_K=config.SPLIT_K, SILU_MUL=silu_mul,
                QUANT_ROWS=quant_rows(M, config.BLOCK_M) if quantize else config.BLOCK_M,
                # the residual + RMSNorm epilogue's tensors (GemmPlan's add_norm binds them); unused without ADD_NORM
                res_ptr=y, norm_w_ptr=y, h_ptr=y, sumsq_ptr=partials, row_arrivals_ptr=y, eps=0.0, ADD_NORM=False)
    return Launch(_fp8_gemm_kernel, gemm_grid(M, N, config), args, config.num_warps, config.num_stages), y


def fp8_word_decode(x: torch.Tensor, weight: torch.Tensor, cc: int | None = None) -> bool:
    """Whether the weight-only path decodes the e4m3 weight [N, K] 4 bytes a word (`common.e4m3_words_to_halves`,
    inline PTX) for activations like x: where `common.half_bit_tricks` allows it (fp16 / bf16 from sm_80, fp16 under
    the interpreter; sm_75 keeps the byte decode) and the bytes read as int32 words (K and the storage offset
    multiples of 4)."""
    return half_bit_tricks(x, cc) and weight.shape[1] % 4 == 0 and weight.storage_offset() % 4 == 0


def tuned_config(M: int, N: int, K: int, weight_only: bool, block_k: int = 128, cc: int | None = 90,
                 block_scaled: bool = False) -> FP8GemmConfig:
    """The launcher's config: the one tuned for this shape's bucket and path (the weight-only path is
    tuned apart, as `fp8_gemm_weight_only`), else `default_config` for sm_`cc` (None: the interpreter); M is
    `config_rows`'s (one config for every M in the batch-invariant mode)."""
    M = config_rows(M)
    return tuned_or_default("fp8_gemm_weight_only" if weight_only else "fp8_gemm", config_bucket(M, N, K),
                            default_config(M, N, K, block_k, cc, block_scaled, weight_only))


def default_config(M: int, N: int, K: int, block_k: int = 128, cc: int | None = 90, block_scaled: bool = False,
                   weight_only: bool = False) -> FP8GemmConfig:
    """Untuned defaults: decode splits K so that ~2 waves of programs stream the weight, over 128 columns (fp8 x fp8:
    the activation rows, quantized once per K tile, serve twice the weights of 64, and sm_90's dot upcasts them per
    warp; weight-only: the loop's addressing spread over twice the weights), 64 on sm_75 (its byte decode spills);
    prefill takes 128 x 128 tiles, but 128 x 64 before sm_90 for block-scaled weights (a per-tile scale) and
    on the weight-only path (the in-kernel e4m3 decode), whose registers make 128 x 128 spill: 8 bytes on
    sm_89 block-scaled, 24-32 bytes weight-only on sm_80 (AOT, Triton 3.7.1 and 3.9); 128 x 64 none."""
    if M <= 16:
        block_n = 64 if cc is not None and cc < 80 else 128
        return FP8GemmConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1,
                             SPLIT_K=decode_split_k(N, K, block_k, block_n), num_warps=4, num_stages=4)
    if M <= 64:
        return FP8GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, num_stages=4)
    narrow = cc is not None and cc < 90 and (block_scaled or weight_only)
    return FP8GemmConfig(BLOCK_M=128, BLOCK_N=64 if narrow else 128, BLOCK_K=block_k, num_warps=8, num_stages=3)


def _weight_scale_layout(w: FP8Weight) -> tuple[int, int, int, int]:
    """(stride along N, stride along K, rows per scale, columns per scale) of w.weight_scale."""
    N, K = w.shape
    s = w.weight_scale
    if w.block_size is not None:
        return s.stride(0), s.stride(1), w.block_size[0], w.block_size[1]
    if s.numel() == 1:
        return 0, 0, 1, K
    return s.stride(0), 0, 1, K  # per channel


def _check_weight(w: FP8Weight) -> None:
    check_gemm_weight("fp8_gemm", w, FP8Weight, torch.float8_e4m3fn,
                      "; convert e5m2/fnuz checkpoints to e4m3fn when loading")
    N, K = w.shape
    s = w.weight_scale
    if s.dtype != torch.float32:
        raise ValueError(f"FP8Weight.weight_scale must be float32, got {s.dtype}")
    if w.block_size is not None:
        bn, bk = w.block_size
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"FP8Weight.block_size {w.block_size}: the K block must be a power of two >= 16")
        expected = (triton.cdiv(N, bn), triton.cdiv(K, bk))
        if tuple(s.shape) != expected:
            raise ValueError(f"block weight_scale has shape {tuple(s.shape)}, expected {expected} "
                             f"= (ceil(N/{bn}), ceil(K/{bk})) for weight [{N}, {K}]")
    elif s.numel() != 1 and tuple(s.shape) not in ((N, 1), (N,)):
        raise ValueError(f"weight_scale has shape {tuple(s.shape)}; expected [] (per tensor) or [{N}, 1] "
                         "(per channel), or set block_size for block scales")
    if w.input_scale is not None and w.input_scale.numel() != 1:
        raise ValueError(f"FP8Weight.input_scale must hold one value (static per-tensor activation scale), "
                         f"got shape {tuple(w.input_scale.shape)}")
    if w.bias is not None and tuple(w.bias.shape) != (N,):
        raise ValueError(f"FP8Weight.bias has shape {tuple(w.bias.shape)}, expected [{N}]")


def _check_activation(x: torch.Tensor, group_size: int | None, input_scale: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_activation_fp8 expects x [M, K] fp16/bf16/fp32, got {x.dtype} {tuple(x.shape)}")
    if group_size is not None and (group_size < 1 or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two or None (per token), got {group_size}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale must hold one value, got shape {tuple(input_scale.shape)}")


def quantize_activation_fp8_reference(x: torch.Tensor, group_size: int | None = None,
                                      input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `quantize_activation_fp8` (same arithmetic, float32)."""
    xf = x.float()
    M, K = xf.shape
    if input_scale is not None:
        scales = input_scale.reshape(()).to(device=x.device, dtype=torch.float32)
        expanded = scales
    else:
        group = K if group_size is None else group_size
        n_groups = -(-K // group)
        padded = torch.nn.functional.pad(xf, (0, n_groups * group - K)).view(M, n_groups, group)
        absmax = padded.abs().amax(dim=2).clamp(min=SCALE_EPS)
        # By a tensor, not the number: CUDA torch computes `t / number` as t * (1 / number), which
        # rounds twice; tensor / tensor is IEEE division everywhere, as in the kernel (div_rn).
        scales = absmax / torch.full_like(absmax, FP8_MAX)
        expanded = scales.repeat_interleave(group, dim=1)[:, :K]
    q = (xf / expanded).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales


def fp8_round_trip(x: torch.Tensor, group_size: int | None = None,
                   input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] as an fp8 x fp8 GEMM sees it, float32: quantized to e4m3 exactly as `quantize_activation_fp8`
    (per token, per 1 x group_size group, or by the static input_scale) and scaled back."""
    K = x.shape[1]
    q, scales = quantize_activation_fp8_reference(x, group_size, input_scale)
    if scales.dim() == 2:
        scales = scales.repeat_interleave(group_size or K, dim=1)[:, :K]
    return q.float() * scales


def quantized_activations(x: torch.Tensor, w: FP8Weight, weight_only: bool = False) -> torch.Tensor:
    """x [M, K] as the fp8 GEMM sees it, float32: quantized to e4m3 and scaled back (per token, per
    block_size[1] group for block weights, or by w.input_scale), or just x.float() with weight_only."""
    if weight_only:
        return x.float()
    return fp8_round_trip(x, w.block_size[1] if w.block_size is not None else None, w.input_scale)


def fp8_gemm_reference(x: torch.Tensor, w: FP8Weight, weight_only: bool = False) -> torch.Tensor:
    """Torch version of `fp8_gemm` for x [M, K] (float32 compute): quantizes x exactly like the
    kernel (or not, with weight_only), multiplies by the dequantized weight, adds bias."""
    y = quantized_activations(x, w, weight_only) @ w.dequantize().T
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Tuning (python -m tritonq.tune --kernel fp8_gemm): shapes MxNxK
# ----------------------------------------------------------------------------------------------

def sweep_space(shape: tuple[int, int, int]) -> list[dict]:
    """CONFIG_SPACE for shape (M, N, K): decode sizes (M <= 16) use BLOCK_M 16 and no GROUP_M
    swizzle; split-K only up to M 64; tiles no wider than M, N (rounded up) and K per split."""
    M, N, K = shape
    out = []
    for values in itertools.product(*CONFIG_SPACE.values()):
        c = dict(zip(CONFIG_SPACE, values))
        if M <= 16 and (c["BLOCK_M"] != 16 or c["GROUP_M"] != 1):
            continue
        if c["BLOCK_M"] > max(16, triton.next_power_of_2(M)) or (M > 64 and c["SPLIT_K"] > 1):
            continue
        if c["BLOCK_N"] > max(32, triton.next_power_of_2(N)) or c["BLOCK_K"] * c["SPLIT_K"] > K:
            continue
        out.append(c)
    return out


def aot_launch(config: FP8GemmConfig, M: int, N: int, K: int, cc: int, dtype: torch.dtype = torch.float16,
               block: bool = True, bias: bool = False) -> Launch:
    """`fp8_gemm_launch` over meta tensors for sm_`cc`: an N x K e4m3 weight with 128 x 128 block scales
    (else one per channel), fp16/bf16 activations: quantized to e4m3 per token (per 128-group with
    block scales) from sm_89, inside the GEMM up to QUANTIZE_IN_GEMM_MAX_M rows; the weight-only path below."""
    meta = torch.device("meta")
    scale = (torch.empty(triton.cdiv(N, 128), triton.cdiv(K, 128), dtype=torch.float32, device=meta) if block
             else torch.empty(N, 1, dtype=torch.float32, device=meta))
    w = FP8Weight(torch.empty(N, K, dtype=torch.float8_e4m3fn, device=meta), scale,
                  block_size=(128, 128) if block else None,
                  bias=torch.empty(N, dtype=dtype, device=meta) if bias else None)
    if cc < 89 or M <= QUANTIZE_IN_GEMM_MAX_M:  # weight-only, or the activations quantized in the GEMM
        a, a_scale = torch.empty(M, K, dtype=dtype, device=meta), None
    else:
        a = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=meta)
        a_scale = torch.empty(M, triton.cdiv(K, 128) if block else 1, dtype=torch.float32, device=meta)
    return fp8_gemm_launch(a, a_scale, w, config, dtype, quantize=cc >= 89 and M <= QUANTIZE_IN_GEMM_MAX_M, cc=cc)[0]
