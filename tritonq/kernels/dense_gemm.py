"""Dense GEMM of the batch-invariant mode on the GPU: y = x @ W^T (+ bias), one Triton kernel, one launch config.

Outside the mode a dense linear is torch's F.linear (cuBLAS), which picks its kernel, tiles and split-K from the
shape, M included, so a row's sums change with the number of rows beside it. In the mode (kernels.batch_invariant(),
tritonq.kernels.linear.LINEARS' dense entry) dense linears run this kernel with one config for every M (`config`: 64 x 64 output
tiles, 64-deep K steps in order, no split-K; 32-deep with 8 warps on sm_75, whose FMA dots spill 2.6 KB at 64), so
each output is the same chain of tile products whatever the batch, as the fixed-config Triton matmuls of vLLM's and
SGLang's batch-invariant modes do. fp32 accumulation, the bias added in
fp32, one rounding to x's dtype; fp32 operands multiply in IEEE fp32 (`common.ieee_dot`, not tf32).
`dense_gemm_reference` (float32 torch) is the test oracle.

`DenseGemm` is a dense weight's GEMM on the GPU: F.linear, or this kernel in the mode. At decode (M <= DECODE_MAX_M)
it also runs the kernel for the two fused layer epilogues: a SwiGLU gate_up linear (silu_mul=True; each tile reads
gate row i and up row i as its column pair (2i, 2i + 1) by its row indices, not from a re-laid-out weight, and stores
silu(gate) * up, `common.store_output`) and an o_proj with the residual addition and the next RMSNorm
(`add_rms_norm`, `common.add_rms_norm_tile`): one launch each for what is otherwise cuBLAS and a second kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonq.kernels import backend, batch_invariant
from tritonq.kernels.common import (GemmConfig, Launch, arrival_counts, check_gemm_activations,
                                    compute_capability, gemm_grid, gemm_tile, ieee_dot, next_pow2, store_gemm_tile,
                                    upcast_dot)
from tritonq.kernels.norm_rope import silu_mul
from tritonq.quant.weights import DenseWeight


# Up to this many rows (decode steps) DenseGemm runs the fused epilogues in this kernel instead of cuBLAS + a kernel.
DECODE_MAX_M = 16


def config(cc: int | None) -> GemmConfig:
    """The one launch config on sm_`cc` (None: the interpreter), whatever the row count."""
    if cc is not None and cc < 80:
        return GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=2)
    return GemmConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=3)


@triton.jit
def _dense_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_wk, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr, SILU_MUL: tl.constexpr,
                       res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr, eps, ADD_NORM: tl.constexpr):
    """One program: a [BLOCK_M, BLOCK_N] tile of y over all of K, BLOCK_K at a time in order. SILU_MUL: W is a
    gate_up weight [N = 2I, K] (gate rows, then up rows); tile column 2i + j reads row j * I + i, and y [M, I] gets
    silu(gate) * up of each pair. ADD_NORM: y = the tile + residual, h its RMSNorm (`common.add_rms_norm_tile`;
    grid (row blocks, column tiles), no grouped order)."""
    rows, offs_n, offs_k, mask_m, mask_n, k_start, k_end = gemm_tile(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, 1)
    w_rows = offs_n
    if SILU_MUL:
        w_rows = (offs_n % 2) * (N // 2) + offs_n // 2
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + w_rows[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
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
    if HAS_BIAS:  # by the weight's row (one K slice: added once)
        acc += tl.load(bias_ptr + w_rows, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    # one K slice: no partials or arrival counters (y stands for both, never read); ADD_NORM: GROUP_M 1
    store_gemm_tile(y_ptr, acc, bias_ptr, y_ptr, y_ptr, rows, offs_n, mask_m, mask_n, stride_ym, M, N, False, 1,
                    SILU_MUL, res_ptr, norm_w_ptr, h_ptr, sumsq_ptr, row_arrivals_ptr, eps, ADD_NORM)


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


class DenseGemm:
    """A dense weight's GEMM off the CPU backend: x [..., K] -> y [..., N], F.linear (cuBLAS), or _dense_gemm_kernel
    in the batch-invariant mode. silu_mul: w is a SwiGLU gate_up weight [2I, K] (gate rows, then up rows) and a call
    returns silu(gate) * up [..., I]: the kernel with the SwiGLU epilogue up to DECODE_MAX_M rows and for every M in
    the mode (its one config), else F.linear then silu_mul. `add_rms_norm`: the residual + RMSNorm epilogue."""

    HAS_ADD_NORM_EPILOGUE = True  # as WeightGemm's: `add_rms_norm` below

    def __init__(self, w: DenseWeight, silu_mul: bool = False):
        N, K = w.weight.shape
        if silu_mul and N % 2:
            raise ValueError(f"DenseGemm: the gate_up weight has N={N} rows, expected an even number (gate rows, "
                             "then up rows); fuse the gate and up weights first")
        self.w, self.N, self.K, self.silu_mul = w, N, K, silu_mul
        self.cc = compute_capability(w.weight.device)
        self.row_arrivals = {}  # max rows -> the add_rms_norm launches' arrival counts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        on_triton = backend(x) == "triton"
        invariant = batch_invariant() and on_triton
        if not self.silu_mul:
            return dense_gemm(x, self.w) if invariant else torch.nn.functional.linear(x, self.w.weight, self.w.bias)
        rows = x.reshape(-1, self.K)
        if not (invariant or (on_triton and rows.shape[0] <= DECODE_MAX_M)):
            return silu_mul(torch.nn.functional.linear(x, self.w.weight, self.w.bias))
        check_gemm_activations("DenseGemm", x, self.N, self.K, self.w.weight.device)
        y = torch.empty(rows.shape[0], self.N // 2, dtype=x.dtype, device=x.device)
        if rows.shape[0]:
            dense_gemm_launch(rows.contiguous(), self.w, y, self.cc, silu_mul=True)()
        return y.view(*x.shape[:-1], self.N // 2)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(y = x @ W^T + residual, RMSNorm(y) * norm_weight) [M, N] in one launch at decode; None elsewhere (more
        than DECODE_MAX_M rows, the batch-invariant mode, off the Triton backend, shapes or dtypes the kernel does
        not take): the caller runs the GEMM and norm_rope.add_rms_norm."""
        M = x.shape[0]
        if (self.silu_mul or M > DECODE_MAX_M or batch_invariant() or backend(x) != "triton" or x.dim() != 2
                or x.shape[1] != self.K or x.dtype != self.w.weight.dtype or residual.shape != (M, self.N)
                or residual.dtype != x.dtype or not residual.is_contiguous() or norm_weight.shape != (self.N,)
                or x.device != self.w.weight.device):
            return None
        max_m = next_pow2(M)
        cfg = config(self.cc)
        arrivals = self.row_arrivals.get(max_m)
        if arrivals is None:
            arrivals = self.row_arrivals[max_m] = arrival_counts(triton.cdiv(max_m, cfg.BLOCK_M), x.device)
        y, h = torch.empty_like(residual), torch.empty_like(residual)
        sumsq = torch.empty(triton.cdiv(self.N, cfg.BLOCK_N), M, dtype=torch.float32, device=x.device)
        launch = dense_gemm_launch(x.contiguous(), self.w, y, self.cc)
        launch.args.update(res_ptr=residual, norm_w_ptr=norm_weight, h_ptr=h, sumsq_ptr=sumsq,
                           row_arrivals_ptr=arrivals, eps=eps, ADD_NORM=True, GROUP_M=1)
        launch()
        return y, h


def dense_gemm_launch(x: torch.Tensor, w: DenseWeight, y: torch.Tensor, cc: int | None,
                      silu_mul: bool = False) -> Launch:
    """The launch of _dense_gemm_kernel for x [M, K] (contiguous) @ w into y [M, N] with `config(cc)`; silu_mul:
    w is a gate_up weight and y [M, N / 2] gets silu(gate) * up (`DenseGemm`). DenseGemm.add_rms_norm binds the
    residual + RMSNorm epilogue's tensors (unused here)."""
    cfg = config(cc)
    M, K = x.shape
    N = w.weight.shape[0]
    bias = w.bias if w.bias is not None else y
    args = dict(x_ptr=x, w_ptr=w.weight, bias_ptr=bias, y_ptr=y, M=M, N=N, K=K, stride_xm=x.stride(0),
                stride_wn=w.weight.stride(0), stride_wk=w.weight.stride(1), stride_ym=y.stride(0),
                BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M,
                HAS_BIAS=w.bias is not None, UPCAST_DOT=upcast_dot(x), SILU_MUL=silu_mul,
                res_ptr=y, norm_w_ptr=y, h_ptr=y, sumsq_ptr=y, row_arrivals_ptr=y, eps=0.0, ADD_NORM=False)
    return Launch(_dense_gemm_kernel, gemm_grid(M, N, cfg), args, cfg.num_warps, cfg.num_stages)


def dense_gemm_reference(x: torch.Tensor, w: DenseWeight) -> torch.Tensor:
    """dense_gemm in float32 torch, rounded to x's dtype once."""
    bias = None if w.bias is None else w.bias.float()
    return torch.nn.functional.linear(x.float(), w.weight.float(), bias).to(x.dtype)
