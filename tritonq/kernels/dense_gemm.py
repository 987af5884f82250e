"""Dense GEMM of the batch-invariant mode on the GPU: y = x @ W^T (+ bias), one Triton kernel, one launch config.

Outside the mode a dense linear is torch's F.linear (cuBLAS), which picks its kernel, tiles and split-K from the
shape, M included, so a row's sums change with the number of rows beside it. In the mode (kernels.batch_invariant(),
tritonq.kernels.linear.LINEARS' dense entry) dense linears run this kernel with one config for every M (`config`: 64 x 64 output
tiles, 64-deep K steps in order, no split-K; 32-deep with 8 warps on sm_75, whose FMA dots spill 2.6 KB at 64), so
each output is the same chain of tile products whatever the batch, as the fixed-config Triton matmuls of vLLM's and
SGLang's batch-invariant modes do. fp32 accumulation, the bias added in
fp32, one rounding to x's dtype; fp32 operands multiply in IEEE fp32 (`common.ieee_dot`, not tf32).
`dense_gemm_reference` (float32 torch) is the test oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonq.kernels.common import (GemmConfig, Launch, check_gemm_activations, compute_capability, gemm_grid,
                                    gemm_tile, ieee_dot, store_gemm_tile, upcast_dot)
from tritonq.quant.weights import DenseWeight


def config(cc: int | None) -> GemmConfig:
    """The one launch config on sm_`cc` (None: the interpreter), whatever the row count."""
    if cc is not None and cc < 80:
        return GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=2)
    return GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=3)


@triton.jit
def _dense_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_wk, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One program: a [BLOCK_M, BLOCK_N] tile of y over all of K, BLOCK_K at a time in order."""
    rows, offs_n, offs_k, mask_m, mask_n, k_start, k_end = gemm_tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, 1)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST_DOT:
            acc = ieee_dot(a.to(tl.float32), w.to(tl.float32), acc)
        else:
            acc = tl.dot(a, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    # one K slice: no partials or arrival counters (y stands for both, never read)
    store_gemm_tile(y_ptr, acc, bias_ptr, y_ptr, y_ptr, rows, offs_n, mask_m, mask_n, stride_ym, M, N, HAS_BIAS, 1)


def dense_gemm(x: torch.Tensor, w: DenseWeight) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w.weight^T (+ w.bias) in x's dtype, with one config whatever the row count."""
    N, K = w.weight.shape
    check_gemm_activations("dense_gemm", x, N, K, w.weight.device)
    if w.weight.dtype != x.dtype:
        raise ValueError(f"dense_gemm: x is {x.dtype} but the weight is {w.weight.dtype}; pass activations of the "
                         "weight's dtype")
    rows = x.reshape(-1, K).contiguous()
    y = torch.empty(rows.shape[0], N, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        dense_gemm_launch(rows, w, y, compute_capability(x.device))()
    return y.view(*x.shape[:-1], N)


def dense_gemm_launch(x: torch.Tensor, w: DenseWeight, y: torch.Tensor, cc: int | None) -> Launch:
    """The launch of _dense_gemm_kernel for x [M, K] (contiguous) @ w into y [M, N] with `config(cc)`."""
    cfg = config(cc)
    M, K = x.shape
    N = w.weight.shape[0]
    bias = w.bias if w.bias is not None else y
    args = dict(x_ptr=x, w_ptr=w.weight, bias_ptr=bias, y_ptr=y, M=M, N=N, K=K, stride_xm=x.stride(0),
                stride_wn=w.weight.stride(0), stride_wk=w.weight.stride(1), stride_ym=y.stride(0),
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                HAS_BIAS=w.bias is not None, UPCAST_DOT=upcast_dot(x))
    return Launch(_dense_gemm_kernel, gemm_grid(M, N, cfg), args, cfg.num_warps, cfg.num_stages)


def dense_gemm_reference(x: torch.Tensor, w: DenseWeight) -> torch.Tensor:
    """dense_gemm in float32 torch, rounded to x's dtype once."""
    bias = None if w.bias is None else w.bias.float()
    return torch.nn.functional.linear(x.float(), w.weight.float(), bias).to(x.dtype)
