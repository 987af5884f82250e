"""W8A8 INT8 GEMM: y [M, N] = x [M, K] @ W^T for int8 weights W [N, K] and int8 activations.

Weights (W8A8Weight): int8 codes, W = weight * weight_scale, scale [] (tensor) or [N, 1] (channel).
Activations are quantized to int8 by `quantize_activation_int8` (a Triton kernel, one program per
row), as compressed-tensors defines it (compressed_tensors.quantization: calculate_qparams, and
round_to_quantized_type_args: clamp to [-128, 127], then torch.round, i.e. half to even):
  dynamic per token   scale = absmax(row) / 127.5, q = round(x / scale)
  static per tensor   scale = W8A8Weight.input_scale, q = round(x / scale)
  static asymmetric   q = round(x / scale + input_zero_point), x ~= (q - zero_point) * scale
Division is IEEE (div_rn), so the codes equal the torch reference's bit for bit. Up to QUANTIZE_IN_GEMM_MAX_M
rows (decode) the GEMM kernel quantizes the tiles it reads itself (each program reads its rows' absmax over all
of K: x is a few KB there), the same codes, so a linear is one launch.

One @triton.jit GEMM kernel: tl.dot on int8 operands with an int32 accumulator (exact), then in
the epilogue the asymmetric correction acc - zero_point * sum_k W[n, k] (the column sums are
accumulated from the same weight tiles, so no extra pass over W), the scales a_scale[m] *
w_scale[n] in fp32, and the bias. sm_80/86/89 run mma.sync s8 and sm_90 wgmma s8 (checked by
tests/aot/test_fit.py). sm_75: Triton 3.x lowers every tl.dot to FMAs there and its int8 FMA lowering
does not compile (TritonGPUAccelerateMatmul emits an fp extension of the i8 operands; Triton 3.9),
so FP16_DOT converts the int8 tiles to fp16 in registers (exact: |code| <= 128) and dots them into
an fp32 accumulator: the same codes and the same products (exact in fp32), sums exact below 2^24.
It still reads one byte per weight (half of fp16; decode is memory bound); a weight-only variant
would skip the activation pass too, but would give other numbers than every other GPU.
Decode-sized M splits K across programs (SPLIT_K), each slice writing its scaled fp32 partial to
its own plane of a [SPLIT_K, M, N] buffer that the last slice to finish sums in the same launch
(`common.reduce_split_k`), as fp8_gemm does.

CPU tensors (no interpreter) run torch's int8 GEMM `torch._int_mm` (int8 x int8 -> int32, oneDNN) on
the activations quantized by the torch reference quantizer, with the weight passed as a transposed view
of its [N, K] storage. Measured on one core of the shared box (N = 2816, K = 1024, min of 31, ms):
_int_mm vs fp32 GEMM on the weight dequantized once vs bf16 GEMM: M = 1: 0.25 / 0.44 / 0.39;
M = 16: 0.25 / 0.82 / 0.43; M = 64: 0.37 / 2.6 / 0.73; M = 256: 1.1-1.8 / 22 / 1.6-2.1
(`_weight_int8pack_mm`, int8 weights with fp32 activations, is 2-1000x slower); and it keeps weights
at one byte. `int8_gemm_reference` (TRITONQ_BACKEND=torch) is the oracle: the same activation codes,
an exact integer product (float64), the same fp32 epilogue.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from tritonq.kernels import backend, batch_invariant
from tritonq.kernels.common import (WeightGemm, QUANTIZE_IN_GEMM_MAX_M, GemmConfig, GemmPlan, Launch, activation_rows, activation_scale,
    broadcast_rows, check_gemm_activations, check_gemm_weight, check_launch_config, compute_capability, config_rows,
    decode_split_k, divide_by_scale, gemm_grid, gemm_output, gemm_tile, k_tile_mask, next_pow2, quant_rows, rows_absmax,
    silu_mul_pairs, split_k_arrivals, store_gemm_tile, tuned_or_default)
from tritonq.kernels.common import gemm_config_bucket as config_bucket
from tritonq.quant.weights import W8A8Weight

INT8_MIN, INT8_MAX = -128.0, 127.0
DYNAMIC_DIVISOR = 127.5  # compressed-tensors' symmetric int8 scale: absmax / ((127 - (-128)) / 2)
SCALE_EPS = 1e-10  # floor on absmax so all-zero rows get a finite scale (and quantize to 0)
# Adding 1.5 * 2^23 rounds an fp32 |v| < 2^22 to an integer, ties to even (torch.round's rule): at that magnitude the
# fp32 ulp is 1, and the sum's bits are 0x4B400000 + the integer (two's complement in the low bits).
_ROUND_MAGIC = tl.constexpr(12582912.0)
_INT8_MIN, _INT8_MAX = tl.constexpr(INT8_MIN), tl.constexpr(INT8_MAX)
_DYNAMIC_DIVISOR = tl.constexpr(DYNAMIC_DIVISOR)
_SCALE_EPS = tl.constexpr(SCALE_EPS)


class Int8GemmConfig(GemmConfig):
    """Launch config of _int8_gemm_kernel (the fields of `common.GemmConfig`)."""


@triton.jit
def _quantize_activation_int8_kernel(x_ptr, q_ptr, s_ptr, static_scale_ptr, zero_point_ptr, K, stride_xm,
                                     stride_qm, BLOCK: tl.constexpr, STATIC: tl.constexpr,
                                     ASYMMETRIC: tl.constexpr):
    """One program per row: (absmax -> scale, or the static scale) -> x / scale (+ zero point) -> clamp ->
    round half to even -> int8."""
    row = tl.program_id(0).to(tl.int64)  # row x stride: past 2^31 elements for M * K >= 2^31
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = activation_scale(x, static_scale_ptr, STATIC, _DYNAMIC_DIVISOR, _SCALE_EPS)
    if not STATIC:
        tl.store(s_ptr + row, scale)
    tl.store(q_ptr + row * stride_qm + offs, _quantize_int8(x, scale, zero_point_ptr, ASYMMETRIC), mask=mask)


@triton.jit
def _quantize_int8(x, scale, zero_point_ptr, ASYMMETRIC: tl.constexpr):
    """fp32 x / scale (a scalar, or broadcasting against x) (+ the zero point) -> clamp -> round half to even ->
    int8. The division rounds as IEEE division does (`common.divide_by_scale`), like torch (plain `/` is approximate
    on NVIDIA)."""
    v = divide_by_scale(x, scale)
    if ASYMMETRIC:
        v += tl.load(zero_point_ptr).to(tl.float32)
    # + 1.5 * 2^23 rounds to an integer (half to even) in the low mantissa bits: the low byte is the int8 code
    return (tl.clamp(v, _INT8_MIN, _INT8_MAX) + _ROUND_MAGIC).to(tl.int32, bitcast=True).to(tl.int8)


@triton.jit
def _int8_gemm_kernel(a_ptr, a_scale_ptr, a_zero_ptr, w_ptr, w_scale_ptr, bias_ptr, y_ptr, partials_ptr, arrivals_ptr,
                      M, N, K, stride_am, stride_wn, stride_ym, stride_asm, stride_wsn,
                      ASYMMETRIC: tl.constexpr, HAS_BIAS: tl.constexpr, FP16_DOT: tl.constexpr,
                      QUANTIZE_A: tl.constexpr, STATIC_A: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr, QUANT_ROWS: tl.constexpr,
                      EVEN_K: tl.constexpr,
                      res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr, eps, ADD_NORM: tl.constexpr):
    """y[M, N] = ((a - a_zero) @ w^T) * a_scale[m] * w_scale[n] (+ bias); SILU_MUL: y [M, N / 2] = SwiGLU of the
    (gate, up) column pairs (`common.store_output`); ADD_NORM: y + residual and its RMSNorm h
    (`common.add_rms_norm_tile`).

    a int8 [M, K], a_scale fp32 [M] (stride_asm 0: one static scale), a_zero int32 [] (ASYMMETRIC),
    w int8 [N, K], w_scale fp32 [N] (stride_wsn 0: per tensor). SPLIT_K > 1 (decode): program_id(1) takes
    one K slice; the slices' scaled partials meet in `common.reduce_split_k`, in this launch. EVEN_K: K is a multiple
    of BLOCK_K, no K tile is partial (`common.k_tile_mask`).
    QUANTIZE_A (decode M): a is the fp16/bf16/fp32 activations, quantized here tile by tile exactly as
    `quantize_activation_int8` does (per token from `rows_absmax` over all of K, or the static scale at
    a_scale_ptr with STATIC_A), so the GEMM is the linear's only launch. It quantizes QUANT_ROWS rows (the M bucket,
    `common.quant_rows`), not the dot's padding rows, and copies them up to BLOCK_M (`common.broadcast_rows`).
    """
    rows, offs_n, offs_k, mask_m, mask_n, k_start, k_end = gemm_tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                                                     SPLIT_K)
    a_rows, mask_a = activation_rows(rows, mask_m, M, QUANTIZE_A, QUANT_ROWS)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_start + offs_k)[:, None]  # [BLOCK_K, BLOCK_N]

    if FP16_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    w_sum = tl.zeros((BLOCK_N,), dtype=tl.int32)  # sum_k w[n, k] over this slice (asymmetric correction)
    if QUANTIZE_A:
        if STATIC_A:
            a_scale = tl.load(a_scale_ptr)
        else:  # per token: each program reads its rows' absmax over all of K
            x_rows = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
            absmax = tl.maximum(rows_absmax(x_rows, mask_a, 0, K, BLOCK_K), _SCALE_EPS)
            a_scale = tl.math.div_rn(absmax, tl.zeros_like(absmax) + _DYNAMIC_DIVISOR)[:, None]
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = k_tile_mask(offs_k, k_end - k0, EVEN_K)
        a = tl.load(a_ptrs, mask=mask_a[:, None] & mask_k[None, :], other=0)
        if QUANTIZE_A:  # padding columns meet zero weights, whatever their codes
            a = broadcast_rows(_quantize_int8(a.to(tl.float32), a_scale, a_zero_ptr, ASYMMETRIC), BLOCK_M)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        if FP16_DOT:  # sm_75 (module docstring): int8 codes are exact in fp16, their products in fp32
            acc = tl.dot(a.to(tl.float16), w.to(tl.float16), acc)
        else:
            acc = tl.dot(a, w, acc, out_dtype=tl.int32)  # int8 x int8 -> int32: exact
        if ASYMMETRIC:
            w_sum += tl.sum(w.to(tl.int32), axis=0)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if ASYMMETRIC:  # (q - z) @ w = q @ w - z * sum_k w, the correction exact in int32
        correction = tl.load(a_zero_ptr) * w_sum
        if FP16_DOT:
            acc -= correction.to(tl.float32)[None, :]
        else:
            acc -= correction[None, :]
    out = acc.to(tl.float32)
    if QUANTIZE_A:
        out *= a_scale if STATIC_A else broadcast_rows(a_scale, BLOCK_M)
    else:
        out *= tl.load(a_scale_ptr + rows * stride_asm, mask=mask_m, other=0.0)[:, None]
    out *= tl.load(w_scale_ptr + offs_n * stride_wsn, mask=mask_n, other=0.0)[None, :]
    store_gemm_tile(y_ptr, out, bias_ptr, partials_ptr, arrivals_ptr, rows, offs_n, mask_m, mask_n, stride_ym, M, N,
                    HAS_BIAS, SPLIT_K, SILU_MUL, res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr, eps, ADD_NORM)


# ----------------------------------------------------------------------------------------------
# Activation quantization
# ----------------------------------------------------------------------------------------------

def quantize_activation_int8(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                             input_zero_point: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp16/bf16/fp32 -> (q [M, K] int8, scales fp32), x ~= (q - input_zero_point) * scales.

    Dynamic per token (input_scale None): scales [M] (absmax / 127.5 per row). Static: scales = input_scale
    (one value, fp32 []), with input_zero_point (one integer) for asymmetric activations.
    """
    _check_activation(x, input_scale, input_zero_point)
    if backend(x) != "triton":
        return quantize_activation_int8_reference(x, input_scale, input_zero_point)
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    if input_scale is not None:
        scales = input_scale.reshape(()).to(device=x.device, dtype=torch.float32)
    else:
        scales = torch.empty((M,), dtype=torch.float32, device=x.device)
    zero = None if input_zero_point is None else input_zero_point.reshape(()).to(device=x.device, dtype=torch.int32)
    quantize_activation_int8_launch(x, q, scales, zero, static=input_scale is not None)()
    return q, scales


def quantize_activation_int8_launch(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                                    zero_point: torch.Tensor | None, static: bool) -> Launch:
    """The launch of _quantize_activation_int8_kernel: x [M, K] (contiguous) into q [M, K] int8 and scales
    ([M] fp32, or the static one-element scale), one program per row. Over meta tensors it is what the AOT
    tests compile."""
    M, K = x.shape
    block = next_pow2(K)
    args = dict(x_ptr=x, q_ptr=q, s_ptr=scales, static_scale_ptr=scales,
                zero_point_ptr=zero_point if zero_point is not None else scales, K=K, stride_xm=x.stride(0),
                stride_qm=q.stride(0), BLOCK=block, STATIC=static, ASYMMETRIC=zero_point is not None)
    return Launch(_quantize_activation_int8_kernel, (M,), args, max(1, min(8, block // 256)), 3)


def quantize_activation_int8_reference(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                                       input_zero_point: torch.Tensor | None = None
                                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of `quantize_activation_int8` (same arithmetic, float32)."""
    xf = x.float()
    if input_scale is not None:
        scales = input_scale.reshape(()).to(device=x.device, dtype=torch.float32)
        v = xf / scales
    else:
        absmax = xf.abs().amax(dim=1).clamp(min=SCALE_EPS)
        # By a tensor, not the number: CUDA torch computes `t / number` as t * (1 / number), which rounds
        # twice; tensor / tensor is IEEE division everywhere, as in the kernel (div_rn).
        scales = absmax / torch.full_like(absmax, DYNAMIC_DIVISOR)
        v = xf / scales[:, None]
    if input_zero_point is not None:
        v = v + input_zero_point.reshape(()).to(device=x.device, dtype=torch.float32)
    return torch.round(v.clamp(INT8_MIN, INT8_MAX)).to(torch.int8), scales


def quantized_activations(x: torch.Tensor, w: W8A8Weight) -> torch.Tensor:
    """x [M, K] as the int8 GEMM sees it, float32: its int8 codes scaled back, (q - zero_point) * scale."""
    q, scales = quantize_activation_int8_reference(x, w.input_scale, w.input_zero_point)
    zero = 0.0 if w.input_zero_point is None else w.input_zero_point.reshape(()).float()
    return (q.float() - zero) * (scales if scales.dim() == 0 else scales[:, None])


# ----------------------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------------------

def int8_gemm(x: torch.Tensor, w: W8A8Weight, config: Int8GemmConfig | None = None,
              fp16_dot: bool | None = None) -> torch.Tensor:
    """x [..., K] fp16/bf16/fp32 @ w [N, K] -> [..., N] in x.dtype (+ w.bias): activations quantized to int8
    (per token, or w's static scale / zero point), int8 x int8 products summed exactly in int32.
    config None: the tuned config for this shape if stored, else `default_config`. fp16_dot None: the fp16
    dot of the int8 codes below sm_80 only (module docstring); True/False force it (tests). Without a
    config the call runs through the weight's `Int8Gemm`, built once per weight object."""
    if config is not None:
        return Int8Gemm(w)(x, config, fp16_dot)
    gemm = _gemms.get(w)
    if gemm is None:
        gemm = _gemms[w] = Int8Gemm(w)
    return gemm(x, fp16_dot=fp16_dot)


class Int8Gemm(WeightGemm):
    """int8_gemm over one weight, checked once here; per (M bucket, x dtype, fp16 dot) the config, grid and
    launch arguments are resolved once (`GemmPlan`). A call checks x, picks the backend and runs the GEMM: one
    launch (the split-K sum inside it, and up to QUANTIZE_IN_GEMM_MAX_M rows the activation quantization too);
    larger M quantize the activations in a launch of their own first. silu_mul: w's rows are (gate, up) pairs and a
    call returns silu(gate) * up [..., N / 2], SwiGLU in the epilogue (`kernels.linear.prepare_gate_up`)."""

    def __init__(self, w: W8A8Weight, silu_mul: bool = False):
        _check_weight(w)
        super().__init__(w)
        self.device, self.plans = w.weight.device, {}
        self.N, self.K = w.shape
        self.silu_mul = silu_mul
        self.cc = compute_capability(self.device)

    def __call__(self, x: torch.Tensor, config: Int8GemmConfig | None = None,
                 fp16_dot: bool | None = None) -> torch.Tensor:
        N, K, w = self.N, self.K, self.w
        check_gemm_activations("int8_gemm", x, N, K, self.device)
        lead = x.shape[:-1]
        x = x.reshape(-1, K)
        b = backend(x)
        if b != "triton":
            y = _cpu_int_mm(x, w) if b == "cpu" else int8_gemm_reference(x, w)
            y = silu_mul_pairs(y) if self.silu_mul else y
        else:
            M = x.shape[0]
            fp16_dot = self._path(x) if fp16_dot is None else fp16_dot
            key = (next_pow2(M), x.dtype, fp16_dot, batch_invariant())
            plan = self.plans.get(key) if config is None else None
            if plan is None:
                plan = self._plan(x, fp16_dot, config, key[0])
                if config is None:
                    self.plans[key] = plan
            if key[0] <= QUANTIZE_IN_GEMM_MAX_M:  # x itself, quantized in the GEMM
                y = plan.run(M, x.dtype, self.device, a_ptr=x, stride_am=x.stride(0))
            else:
                a, a_scale = quantize_activation_int8(x, w.input_scale, w.input_zero_point)
                y = plan.run(M, x.dtype, self.device, a_ptr=a, a_scale_ptr=a_scale.reshape(-1),
                             stride_am=a.stride(0))
        return y.reshape(*lead, -1)

    def _path(self, x: torch.Tensor) -> bool:
        """Whether the GEMM dots the int8 codes in fp16 (below sm_80, module docstring): `WeightGemm.add_rms_norm`'s
        kernel variant, as `__call__` decides it by default."""
        return self.cc is not None and self.cc < 80

    def _plan(self, x: torch.Tensor, fp16_dot: bool, config: Int8GemmConfig | None, max_m: int,
              add_norm: bool = False) -> GemmPlan:
        """The GemmPlan for activations like x, at most max_m rows (config None: `tuned_config`); add_norm (decode
        rows only): with the residual + RMSNorm epilogue (`GemmPlan.run_add_norm`)."""
        config = config or tuned_config(x.shape[0], self.N, self.K, self.cc)
        check_launch_config("int8_gemm", config, Int8GemmConfig)
        arrivals = split_k_arrivals(max_m, self.N, config, x.device)
        if max_m <= QUANTIZE_IN_GEMM_MAX_M:
            launch = int8_gemm_launch(x, None, self.w, config, x.dtype, fp16_dot, arrivals, self.silu_mul)[0]
            per_call = ("a_ptr", "stride_am")
        else:  # stand-ins for the quantized activations and their scales, bound per call
            a = torch.empty(x.shape, dtype=torch.int8, device=x.device)
            a_scale = torch.empty((x.shape[0],) if self.w.input_scale is None else (), dtype=torch.float32,
                                  device=x.device)
            launch = int8_gemm_launch(a, a_scale, self.w, config, x.dtype, fp16_dot, arrivals, self.silu_mul)[0]
            per_call = ("a_ptr", "a_scale_ptr", "stride_am")
        return GemmPlan(launch, "y_ptr", per_call, self.N, config.BLOCK_M, triton.cdiv(self.N, config.BLOCK_N),
                        config.SPLIT_K, flat=True, silu_mul=self.silu_mul, add_norm_rows=max_m if add_norm else 0)


_gemms: WeakIdKeyDictionary = WeakIdKeyDictionary()  # W8A8Weight -> its Int8Gemm (int8_gemm without a Linear)


def int8_gemm_launch(a: torch.Tensor, a_scale: torch.Tensor | None, w: W8A8Weight, config: Int8GemmConfig,
                     out_dtype: torch.dtype, fp16_dot: bool = False,
                     arrivals: torch.Tensor | None = None, silu_mul: bool = False) -> tuple[Launch, torch.Tensor]:
    """The launch of _int8_gemm_kernel and its output y [M, N] in out_dtype (silu_mul: [M, N / 2], SwiGLU of the
    column pairs in the epilogue; with SPLIT_K > 1 also the fp32
    partials and `arrivals`, the split-K counts: `common.gemm_output`). a [M, K] int8 contiguous with a_scale
    from `quantize_activation_int8` ([M] per token, [] static), or with a_scale None the fp16/bf16/fp32 activations
    themselves, quantized inside the GEMM (decode M; per token, or by w's static scale and zero point) to the
    same codes. Over meta tensors this is what the AOT tests compile."""
    (M, K), N = a.shape, w.shape[0]
    weight = w.weight.contiguous()
    w_scale = w.weight_scale.to(torch.float32).reshape(-1)
    quantize, static = a_scale is None, w.input_scale is not None
    if quantize:  # the static scale, or unused (the kernel's own per-token scales)
        a_scale = w.input_scale.reshape(()).to(torch.float32) if static else w_scale
    zero = (w.input_zero_point.reshape(()).to(device=a.device, dtype=torch.int32)
            if w.input_zero_point is not None else w_scale)  # unused unless ASYMMETRIC
    y, partials, arrivals = gemm_output(M, N, config, out_dtype, a.device, arrivals, silu_mul)
    args = dict(a_ptr=a, a_scale_ptr=a_scale.reshape(-1), a_zero_ptr=zero, w_ptr=weight, w_scale_ptr=w_scale,
                bias_ptr=w.bias if w.bias is not None else w_scale, y_ptr=y, partials_ptr=partials,
                arrivals_ptr=arrivals,
                M=M, N=N, K=K, stride_am=a.stride(0), stride_wn=weight.stride(0), stride_ym=y.stride(0),
                stride_asm=1 if a_scale.dim() and not quantize else 0,  # a static scale is shared by every row
                stride_wsn=1 if w_scale.numel() > 1 else 0,
                ASYMMETRIC=w.input_zero_point is not None, HAS_BIAS=w.bias is not None, FP16_DOT=fp16_dot,
                QUANTIZE_A=quantize, STATIC_A=quantize and static,
                BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, GROUP_M=config.GROUP_M,
                SPLIT_K=config.SPLIT_K, SILU_MUL=silu_mul,
                QUANT_ROWS=quant_rows(M, config.BLOCK_M) if quantize else config.BLOCK_M,
                EVEN_K=K % config.BLOCK_K == 0,
                # the residual + RMSNorm epilogue's tensors (GemmPlan's add_norm binds them); unused without ADD_NORM
                res_ptr=y, norm_w_ptr=y, h_ptr=y, sumsq_ptr=partials, row_arrivals_ptr=y, eps=0.0, ADD_NORM=False)
    return Launch(_int8_gemm_kernel, gemm_grid(M, N, config), args, config.num_warps, config.num_stages), y


def tuned_config(M: int, N: int, K: int, cc: int | None = 90) -> Int8GemmConfig:
    """The launcher's config: the one tuned for this shape's bucket (configs/int8_gemm/<gpu>.json), else
    `default_config` for sm_`cc` (None: the interpreter); M is `config_rows`'s (one config for every M in the
    batch-invariant mode)."""
    M = config_rows(M)
    return tuned_or_default("int8_gemm", config_bucket(M, N, K), default_config(M, N, K, cc))


def default_config(M: int, N: int, K: int, cc: int | None = 90) -> Int8GemmConfig:
    """Untuned defaults: decode splits K so that ~2 waves of programs stream the weight, 128 columns a program
    (the activation rows, quantized once per K tile, serve twice the weights of 64); prefill takes
    128 x 128 int8 tiles. sm_75 (FMA dots, module docstring) takes 32-deep K tiles: 16 x 64 at decode,
    64 x 64 with 8 warps at prefill; 64- and 128-deep ones spill there (336-7600 bytes, AOT, Triton 3.9)."""
    fma = cc is not None and cc < 80
    block_k = 32 if fma else 128
    if M <= 16:  # the split counts 128-deep K tiles, also for sm_75's 32-deep ones
        block_n = 64 if fma else 128
        return Int8GemmConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1,
                              SPLIT_K=decode_split_k(N, K, 128, block_n), num_warps=4, num_stages=4)
    if fma:
        return Int8GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=2)
    if M <= 64:
        return Int8GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return Int8GemmConfig(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3)


def _epilogue(acc: torch.Tensor, scales: torch.Tensor, w: W8A8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The torch paths' fp32 epilogue: acc [M, N] (integer sums) x activation scales x w's scales (+ bias),
    in dtype."""
    y = acc.float() * (scales if scales.dim() == 0 else scales[:, None])
    y = y * w.weight_scale.float().reshape(1, -1)
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(dtype)


def int8_gemm_reference(x: torch.Tensor, w: W8A8Weight) -> torch.Tensor:
    """Torch version of `int8_gemm` for x [M, K]: the same activation codes, the integer product exact
    (float64 holds every int8 x int8 sum below 2^53), the same fp32 epilogue, plus bias."""
    q, scales = quantize_activation_int8_reference(x, w.input_scale, w.input_zero_point)
    acc = q.double() @ w.weight.double().T
    if w.input_zero_point is not None:
        acc = acc - w.input_zero_point.reshape(()).double() * w.weight.double().sum(1)
    return _epilogue(acc, scales, w, x.dtype)


_weight_sums: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight tensor -> int32 [N] row sums (CPU asymmetric)


def _cpu_int_mm(x: torch.Tensor, w: W8A8Weight) -> torch.Tensor:
    """The CPU backend: torch._int_mm (int8 x int8 -> int32) on the reference quantizer's codes, then the
    reference's fp32 epilogue (see the module docstring for the measurement)."""
    q, scales = quantize_activation_int8_reference(x, w.input_scale, w.input_zero_point)
    acc = torch._int_mm(q, w.weight.t())  # [N, K] storage as a [K, N] view: the fastest layout measured
    if w.input_zero_point is not None:
        sums = _weight_sums.get(w.weight)
        if sums is None:
            sums = _weight_sums[w.weight] = w.weight.sum(1, dtype=torch.int32)
        acc = acc - w.input_zero_point.reshape(()).to(torch.int32) * sums
    return _epilogue(acc, scales, w, x.dtype)


def _check_weight(w: W8A8Weight) -> None:
    check_gemm_weight("int8_gemm", w, W8A8Weight, torch.int8)
    N, K = w.shape
    s = w.weight_scale
    if not s.is_floating_point() or (s.numel() != 1 and tuple(s.shape) not in ((N, 1), (N,))):
        raise ValueError(f"W8A8Weight.weight_scale has {s.dtype} shape {tuple(s.shape)}; expected a float [] "
                         f"(per tensor) or [{N}, 1] (per channel)")
    if w.input_scale is not None and w.input_scale.numel() != 1:
        raise ValueError(f"W8A8Weight.input_scale must hold one value (static per-tensor activation scale), "
                         f"got shape {tuple(w.input_scale.shape)}")
    if w.input_zero_point is not None and (w.input_scale is None or w.input_zero_point.numel() != 1
                                           or w.input_zero_point.is_floating_point()):
        raise ValueError("W8A8Weight.input_zero_point must be one integer and comes with a static input_scale; "
                         f"got {w.input_zero_point.dtype} shape {tuple(w.input_zero_point.shape)} with input_scale "
                         f"{'None' if w.input_scale is None else 'set'}")
    if w.bias is not None and tuple(w.bias.shape) != (N,):
        raise ValueError(f"W8A8Weight.bias has shape {tuple(w.bias.shape)}, expected [{N}]")


def _check_activation(x: torch.Tensor, input_scale: torch.Tensor | None,
                      input_zero_point: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_activation_int8 expects x [M, K] fp16/bf16/fp32, got {x.dtype} {tuple(x.shape)}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale must hold one value, got shape {tuple(input_scale.shape)}")
    if input_zero_point is not None and (input_scale is None or input_zero_point.numel() != 1):
        raise ValueError("input_zero_point must hold one value and needs a static input_scale")


def aot_launch(config: Int8GemmConfig, M: int, N: int, K: int, cc: int, dtype: torch.dtype = torch.float16,
               asymmetric: bool = False, bias: bool = False) -> Launch:
    """`int8_gemm_launch` over meta tensors for sm_`cc`: an N x K int8 weight with per-channel scales, int8
    activations with per-token scales (or a static scale and zero point with asymmetric), output in dtype; up to
    QUANTIZE_IN_GEMM_MAX_M rows dtype activations, quantized in the GEMM."""
    meta = torch.device("meta")
    f32 = dict(dtype=torch.float32, device=meta)
    w = W8A8Weight(torch.empty(N, K, dtype=torch.int8, device=meta), torch.empty(N, 1, **f32),
                   input_scale=torch.empty((), **f32) if asymmetric else None,
                   input_zero_point=torch.empty((), dtype=torch.int32, device=meta) if asymmetric else None,
                   bias=torch.empty(N, dtype=dtype, device=meta) if bias else None)
    if M <= QUANTIZE_IN_GEMM_MAX_M:
        a, a_scale = torch.empty(M, K, dtype=dtype, device=meta), None
    else:
        a = torch.empty(M, K, dtype=torch.int8, device=meta)
        a_scale = torch.empty((), **f32) if asymmetric else torch.empty(M, **f32)
    return int8_gemm_launch(a, a_scale, w, config, dtype, fp16_dot=cc < 80)[0]
