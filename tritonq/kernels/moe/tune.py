"""Tuning declarations (python -m tritonq.tune --kernel moe): shapes TxExTOPKxDxI, int4 group-128 experts.
The swept space, the shape format and its problems (one per GEMM), the expert layouts over meta tensors
(`meta_experts`, also random_weights' kinds) and the AOT launch builder."""
from __future__ import annotations

import itertools
from dataclasses import replace

import torch
import triton

from tritonq.kernels.common import ClampedSwiGLU, Launch, tune_group_size, unpack_shape
from tritonq.kernels.moe.configs import MoEConfig
from tritonq.kernels.moe.launch import moe_gemm_launch
from tritonq.quant.weights import DenseWeight, FP8Weight, Int4Weight, MXFP4Weight, Weight


# Values the tuner sweeps (the fields of MoEConfig); `sweep_space` keeps those useful for a GEMM.
CONFIG_SPACE = {"BLOCK_M": [16, 32, 64], "BLOCK_N": [64, 128], "BLOCK_K": [64, 128], "num_warps": [4, 8],
                "num_stages": [2, 3]}
TUNE_FORMAT = "TxExTOPKxDxI"
TUNE_GEMMS = ("gate_up", "down")  # a tuning problem is (T, E, TOPK, D, I, index into TUNE_GEMMS)


def tune_problem(shape) -> tuple[int, ...]:
    """(T, E, TOPK, D, I, gemm) checked: TOPK <= E; D and I multiples of 32 (int4 groups)."""
    *dims, gemm = shape if len(shape) == 6 else (*shape, 0)
    T, E, top_k, D, inter = unpack_shape(tuple(dims), "moe", TUNE_FORMAT)
    if top_k > E or D % 32 or inter % 32 or gemm not in (0, 1):
        raise ValueError(f"moe shape {'x'.join(map(str, dims))} ({TUNE_FORMAT}): needs TOPK <= E and D, I "
                         f"multiples of 32 (int4 group size)")
    return T, E, top_k, D, inter, gemm


def sweep_space(problem) -> list[dict]:
    """BLOCK_M up to the tokens per expert (rounded up); BLOCK_N, BLOCK_K up to the GEMM's N, K."""
    T, E, top_k, D, inter, gemm = tune_problem(problem)
    N, K = (inter, D) if gemm == 0 else (D, inter)
    max_m = max(16, triton.next_power_of_2(triton.cdiv(T * top_k, E)))
    out = []
    for values in itertools.product(*CONFIG_SPACE.values()):
        c = dict(zip(CONFIG_SPACE, values))
        if (c["BLOCK_M"] <= max_m and c["BLOCK_N"] <= max(64, triton.next_power_of_2(N))
                and c["BLOCK_K"] <= max(64, triton.next_power_of_2(K))):
            out.append(c)
    return out


# The expert layouts the packers give a MoE layer (and tritonq.random_weights.random_experts fills):
# "int4" / "fp8" (asymmetric group `tune_group_size`, 128x128 blocks: the tuner's and bench's), 8-bit
# (GPTQ 8-bit, W8A16), symmetric act-order (GPTQ desc_act), fp8 per channel / tensor, gpt-oss's mxfp4.
EXPERT_KINDS = ("dense", "int4", "fp8", "int8", "int4-act-order", "fp8-channel", "fp8-tensor", "mxfp4")


def meta_experts(kind: str, E: int, N: int, K: int, dtype: torch.dtype) -> Weight:
    """A stacked expert weight [E, N, K] of `kind` (EXPERT_KINDS) over meta tensors (shapes and dtypes, no
    memory): int4 / int8 asymmetric with groups of `tune_group_size(K)`, int4-act-order symmetric with g_idx
    [E, K], fp8 with 128x128 block scales, fp8-channel [E, N, 1] / fp8-tensor [E] scales, mxfp4 e2m1 blocks
    [E, N, K/32, 16] with E8M0 scales [E, N, K/32]."""
    meta = torch.device("meta")
    if kind == "dense":
        return DenseWeight(torch.empty(E, N, K, dtype=dtype, device=meta))
    if kind in ("int4", "int8", "int4-act-order"):
        bits = 8 if kind == "int8" else 4
        group_size = tune_group_size(K)
        qweight = torch.empty(E, K * bits // 32, N, dtype=torch.int32, device=meta)
        scales = torch.empty(E, K // group_size, N, dtype=dtype, device=meta)
        if kind == "int4-act-order":
            return Int4Weight(qweight, scales, None, torch.empty(E, K, dtype=torch.int32, device=meta), group_size, 4)
        return Int4Weight(qweight, scales, torch.empty_like(scales), None, group_size, bits)
    scale_shape = {"fp8": (E, triton.cdiv(N, 128), triton.cdiv(K, 128)), "fp8-channel": (E, N, 1),
                   "fp8-tensor": (E,)}.get(kind)
    if scale_shape is not None:
        return FP8Weight(torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=meta),
                         torch.empty(scale_shape, dtype=torch.float32, device=meta),
                         block_size=(128, 128) if kind == "fp8" else None)
    if kind == "mxfp4":
        return MXFP4Weight(torch.empty(E, N, K // 32, 16, dtype=torch.uint8, device=meta),
                           torch.empty(E, N, K // 32, dtype=torch.uint8, device=meta))
    raise ValueError(f"meta_experts: kind {kind!r}; choose one of {EXPERT_KINDS}")


def aot_launch(config: MoEConfig, problem, kind: str = "int4", native_fp8: bool = True,
               dtype: torch.dtype = torch.bfloat16, gpt_oss: bool = False, w8a8: bool = False, cc: int = 90,
               mxfp4_max_scale: int | None = None) -> Launch:
    """`moe_gemm_launch` over meta tensors for one GEMM of a tuning problem: activations in dtype, experts
    of `kind` laid out as `meta_experts` gives them (fp8 loaded as float8e4nv if native_fp8, else decoded
    from their bytes). gpt_oss: expert biases and the ClampedSwiGLU epilogue. w8a8 (fp8 kinds, sm_89+): e4m3
    activations with fp32 scales per 1 x 128 group (block weights) or per token, as fused_moe. For sm_`cc`.
    mxfp4_max_scale: the experts' largest E8M0 exponent (None: small enough for one multiply), as `MoEExperts` reads it."""
    T, E, top_k, D, inter, gemm = tune_problem(problem)
    gate = gemm == 0
    N, K, w_rows = (inter, D, 2 * inter) if gate else (D, inter, D)  # w_rows: the stacked weight's N
    weight = meta_experts(kind, E, w_rows, K, dtype)
    if gpt_oss:
        weight = replace(weight, bias=torch.empty(E, w_rows, dtype=dtype, device="meta"))
    meta = torch.device("meta")
    numel = T * top_k
    max_blocks = min(numel, triton.cdiv(numel, config.BLOCK_M) + E + 1)  # as moe_align_block_size
    alignment = (torch.empty(max_blocks * config.BLOCK_M, dtype=torch.int32, device=meta),
                 torch.empty(max_blocks, dtype=torch.int32, device=meta), torch.empty(1, dtype=torch.int32, device=meta))
    rows = T if gate else numel
    a = torch.empty(rows, K, dtype=torch.float8_e4m3fn if w8a8 else dtype, device=meta)
    a_scale = None
    if w8a8:
        group = weight.block_size[1] if weight.block_size is not None else K
        a_scale = torch.empty(rows, triton.cdiv(K, group), dtype=torch.float32, device=meta)
    out = torch.empty(numel, N, dtype=dtype, device=meta)
    routing = torch.empty(numel, dtype=torch.float32, device=meta)
    slot_sum = None if gate else (torch.empty(T, N, dtype=dtype, device=meta),
                                  torch.empty(T, top_k, dtype=torch.int32, device=meta),
                                  torch.empty(triton.cdiv(N, config.BLOCK_N), dtype=torch.int32, device=meta))
    return moe_gemm_launch(a, out, weight, routing, alignment, top_k, config, config.BLOCK_M, gate, native_fp8,
                           ClampedSwiGLU() if gpt_oss and gate else None, a_scale, cc, mxfp4_max_scale, slot_sum)
