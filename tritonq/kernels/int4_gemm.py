"""int4 / int8 weight-only dequantize-GEMM (W4A16, GPTQ 8-bit): y = x @ dequant(w)^T + bias.

Shapes and dtypes:
    x       [M, K] fp16 / bf16 / fp32
    w       Int4Weight (tritonq.weights): qweight [K*bits/32, N] int32 packed along K in
            sequential order, scales [G, N] fp16/bf16/fp32, zeros [G, N] (same dtype) or None for
            symmetric weights (zero = 2^(bits-1)), g_idx [K] int32 or None.
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
    its own [SPLIT_K, M, N] buffer and the launcher sums them (a second pass). This is
    deterministic (atomics are not) and exact to fp32 rounding; the buffer is SPLIT_K * M * N
    fp32, tiny next to the weight at M <= 16.
  * M > 16: a tiled tensor-core GEMM, SPLIT_K = 1, written straight to y in x.dtype.

Groups: when there is no g_idx and group_size is a multiple of BLOCK_K, every K tile lies in
one group, so one [BLOCK_N] row of scales/zeros is loaded per tile (TILE_GROUPS). Otherwise
(act-order g_idx, or a group size that BLOCK_K does not divide) scales/zeros are gathered per
row as a [BLOCK_K, BLOCK_N] tile; these rows hit L1/L2 since G << K. We gather rather than
permute x by a sorted g_idx at run time: no extra kernel or activation copy per call, and the
Int4Weight contract stays one layout.

CPU (no interpreter): torch's int4 CPU kernel (4-bit) or a once-dequantized fp32 weight (8-bit)
over the weight prepared once per object, see kernels/cpu_lowbit.py; `int4_gemm_reference`
(TRITONQ_BACKEND=torch) is the oracle.

Launch configs: `Int4GemmConfig`; defaults in `default_config`, tuned JSON overrides through
`tritonq.kernels.configs.lookup("int4_gemm", config_bucket(M, N, K, w))`, and `CONFIG_SPACE`
lists the values a tuner may sweep.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NoReturn

import torch
import triton
import triton.language as tl

from tritonq.kernels import cpu_lowbit, use_cpu_kernels, use_triton
from tritonq.kernels.configs import lookup
from tritonq.weights import Int4Weight

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
    HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """One program: a [BLOCK_M, BLOCK_N] output tile over K slice pid_k (of SPLIT_K).

    out is [SPLIT_K, M, N] (fp32 partials) when SPLIT_K > 1, else [M, N] in x's dtype.
    """
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        # Load each packed word once ([BLOCK_K / PER_WORD, BLOCK_N]) and unpack it in registers:
        # field i of word r is row r * PER_WORD + i, so the reshape keeps rows in K order.
        offs_word = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
        words = tl.load(qweight_ptr + offs_word[:, None] * N + offs_n[None, :],
                        mask=(offs_word < K // PER_WORD)[:, None] & mask_n[None, :], other=0)
        fields = (words[:, None, :] >> (tl.arange(0, PER_WORD) * BITS)[None, :, None]) & MASK
        q = tl.reshape(fields, (BLOCK_K, BLOCK_N)).to(tl.float32)
        mask_kn = mask_k[:, None] & mask_n[None, :]
        if TILE_GROUPS:  # the whole K tile lies in group k0 // group_size
            g = k0 // group_size
            s = tl.load(scales_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        else:
            if HAS_G_IDX:
                g = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
            else:
                g = offs_k // group_size
            s = tl.load(scales_ptr + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g[:, None] * N + offs_n[None, :], mask=mask_kn, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            w = (q - z) * s
        else:
            w = (q - (1 << (BITS - 1))) * s
        w = w.to(x.dtype)  # weights meet the activations in x's dtype, as on the tensor cores
        if UPCAST_DOT:  # fp32 x (exact ieee dot), or bf16 under the interpreter (see launcher)
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)

    if HAS_BIAS:  # added once: by the first K slice only
        if pid_k == 0:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_config(M: int, N: int, K: int) -> Int4GemmConfig:
    """Defaults in code, used when no tuned JSON entry exists for this GPU and shape."""
    if M <= SPLIT_K_MAX_M:
        block_n, block_k = 64, 128
        n_tiles = triton.cdiv(N, block_n)
        k_tiles = triton.cdiv(K, block_k)
        # Aim for ~2 waves on a 132-SM GPU while keeping >= 2 K tiles per slice.
        split_k = max(1, min(16, _next_pow2(triton.cdiv(264, n_tiles)), k_tiles // 2))
        return Int4GemmConfig(16, block_n, block_k, split_k, num_warps=4, num_stages=4)
    if M <= 64:
        return Int4GemmConfig(max(16, _next_pow2(M)), 64, 64, 1, num_warps=4, num_stages=4)
    return Int4GemmConfig(128, 128, 64, 1, num_warps=8, num_stages=3)


def config_bucket(M: int, N: int, K: int, w: Int4Weight) -> str:
    """Key of the tuned-config JSON: M rounded up to a power of two; exact N, K, group size, bits."""
    return f"M{_next_pow2(M)}_N{N}_K{K}_G{w.group_size}_B{w.bits}"


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
              "pack with tritonq.packing.pack_int32")
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
    if w.bias is not None and tuple(w.bias.shape) != (N,):
        _fail("bias", f"of shape {tuple(w.bias.shape)}", f"[{N}]", "one bias per output")
    for name in ("qweight", "scales", "zeros", "g_idx", "bias"):  # the kernel indexes them densely
        t = getattr(w, name)
        if t is not None and not t.is_contiguous():
            _fail(name, f"non-contiguous with strides {t.stride()}", "a contiguous tensor",
                  "call .contiguous() at load")
    return N, K


def _check_config(config: Int4GemmConfig) -> None:
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            _fail(f"config.{name}", value, "a power of two >= 16 (tl.dot's minimum tile)",
                  f"pick from {CONFIG_SPACE[name]}")
    if config.SPLIT_K < 1:
        _fail("config.SPLIT_K", config.SPLIT_K, ">= 1", "use 1 for no split")


def int4_gemm(x: torch.Tensor, w: Int4Weight, config: Int4GemmConfig | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(w)^T (+ w.bias), in x.dtype. `config` overrides the lookup."""
    N, K = _check_weight(w)
    if x.dim() != 2 or x.shape[1] != K or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        _fail("x", f"{x.dtype} of shape {tuple(x.shape)}", f"fp16/bf16/fp32 [M, {K}]",
              "flatten leading dims to M first")
    if x.device != w.qweight.device:
        _fail("x", f"on {x.device}", f"on the weight's device {w.qweight.device}", "move x or the weight")
    if use_cpu_kernels(x):  # torch's CPU kernel over the weight prepared once (kernels/cpu_lowbit.py)
        return cpu_lowbit.linear(x, cpu_lowbit.prepare(w))
    if not use_triton(x):
        return int4_gemm_reference(x, w)
    if not x.is_cuda:  # interpreter; CUDA relies on the load-time check in gptq_to_int4 (no sync)
        w.check_g_idx()
    M = x.shape[0]
    if config is None:
        tuned = lookup("int4_gemm", config_bucket(M, N, K, w))
        config = Int4GemmConfig(**tuned) if tuned else default_config(M, N, K)
    _check_config(config)
    block_k = config.BLOCK_K
    if w.g_idx is None and w.group_size % block_k:
        # A tile must not straddle two groups for TILE_GROUPS; shrink BLOCK_K to fit if it can.
        block_k = max(math.gcd(block_k, w.group_size), 16)
    tile_groups = w.g_idx is None and w.group_size % block_k == 0
    # Triton's interpreter multiplies bf16 tl.dot operands as raw bits (triton-lang/triton#11584,
    # unsupported upstream), so on CPU the bf16 dot runs in fp32 on the same bf16-rounded values.
    # fp32 x uses an exact (ieee, not tf32) dot.
    upcast_dot = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and not x.is_cuda)
    split_k = config.SPLIT_K
    if split_k > 1:
        out = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, config.BLOCK_M), triton.cdiv(N, config.BLOCK_N), split_k)
    _int4_gemm_kernel[grid](
        x, w.qweight, w.scales, w.zeros if w.zeros is not None else w.scales,
        w.g_idx if w.g_idx is not None else w.qweight, w.bias if w.bias is not None else w.scales, out,
        M, N, K, w.group_size, x.stride(0), x.stride(1),
        BITS=w.bits, HAS_ZEROS=w.zeros is not None, HAS_G_IDX=w.g_idx is not None, TILE_GROUPS=tile_groups,
        HAS_BIAS=w.bias is not None, UPCAST_DOT=upcast_dot,
        BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=block_k, SPLIT_K=split_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out.sum(0).to(x.dtype) if split_k > 1 else out


def int4_gemm_reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """Plain torch: unpack -> dequant -> fp32 matmul (+ bias) -> x.dtype. The oracle (TRITONQ_BACKEND=torch)."""
    _check_weight(w)
    y = x.float() @ w.dequantize().float().t()
    if w.bias is not None:
        y = y + w.bias.float()
    return y.to(x.dtype)
