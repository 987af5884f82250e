"""Random typed weights for benchmarks, the kernels' tune targets and tests: contents
that exercise a kernel (every code value, varied scales), not a trained model.

Each generator makes a weight in tritonq's layout (tritonq/quant/weights.py) on `device`; only the sizes
and the quantization scheme are chosen by the caller. Tests that need an independent reference
build their weights from raw checkpoint tensors instead (tests/kernels/test_int4_gemm.py).
"""
from __future__ import annotations

import torch

from tritonq.kernels.common import tune_group_size
from tritonq.kernels.moe import EXPERT_KINDS
from tritonq.quant.packing import pack_int32
from tritonq.quant.weights import DenseWeight, FP8Weight, Int4Weight, MXFP4Weight, Weight

FP8_SCHEMES = ("tensor", "channel", "block")


def random_int4_weight(N: int, K: int, dtype: torch.dtype, device, group_size: int = 128) -> Int4Weight:
    """Asymmetric 4-bit weight [N, K]: random codes, scales in [0.001, 0.021) and zeros in [0, 16),
    scales/zeros in dtype, one group per group_size input rows."""
    if K % group_size:
        raise ValueError(f"K={K} is not a multiple of group_size={group_size}")
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    groups = K // group_size
    scales = (torch.rand(groups, N) * 0.02 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (groups, N)).to(dtype)
    return Int4Weight(qweight=pack_int32(q, 4, dim=0).to(device), scales=scales.to(device),
                      zeros=zeros.to(device), g_idx=None, group_size=group_size, bits=4)


def random_fp8_weight(N: int, K: int, scheme: str, device) -> FP8Weight:
    """e4m3 codes of std ~64 with positive scales of the given granularity ("tensor", "channel",
    "block": 128 x 128 blocks, the last ones partial when N or K is not a multiple)."""
    if scheme not in FP8_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {FP8_SCHEMES}")
    codes = (torch.randn(N, K, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    if scheme == "tensor":
        return FP8Weight(codes, torch.tensor(1e-3, device=device))
    if scheme == "channel":
        return FP8Weight(codes, torch.rand(N, 1, device=device) * 1e-3 + 1e-4)
    return FP8Weight(codes, torch.rand(-(-N // 128), -(-K // 128), device=device) * 1e-3 + 1e-4,
                     block_size=(128, 128))


def random_experts(kind: str, E: int, N: int, K: int, dtype: torch.dtype, device) -> Weight:
    """A stacked expert weight [E, N, K] of `kind` (EXPERT_KINDS) with random contents made
    on the device, scaled so that x ~ N(0, 1) gives outputs of about unit size.

    int4: asymmetric, group 128 (32 if K is not a multiple), random nibbles (random int32 words) and
    zeros in [6, 10]; int8: the same with 8-bit codes and zeros in [118, 138]; int4-act-order: symmetric,
    each expert's input rows in a random group order (g_idx); fp8: e4m3 codes with 128x128 block scales,
    fp8-channel / fp8-tensor: one scale per output channel / per expert; mxfp4: random e2m1 bytes (K a multiple
    of 32) with E8M0 scales around 2^-log2(3 sqrt K) (e2m1 codes have std ~3).
    """
    if kind == "dense":
        return DenseWeight((torch.randn(E, N, K, device=device) / K ** 0.5).to(dtype))
    if kind in ("int4", "int8", "int4-act-order"):
        bits = 8 if kind == "int8" else 4
        group_size = tune_group_size(K)
        G = K // group_size
        qweight = torch.randint(-2**31, 2**31 - 1, (E, K * bits // 32, N), dtype=torch.int32, device=device)
        # (code - zero) has std ~4.6 (4-bit) / ~74 (8-bit), so these scales make dequantized weights ~N(0, 1/K)
        spread = 4.6 if bits == 4 else 74.0
        scales = ((torch.rand(E, G, N, device=device) * 0.5 + 0.75) / (spread * K ** 0.5)).to(dtype)
        if kind == "int4-act-order":  # symmetric (zero 8); row k of expert e in group g_idx[e, k], groups shuffled
            groups = torch.arange(K, device=device) // group_size
            g_idx = torch.stack([groups[torch.randperm(K, device=device)] for _ in range(E)]).to(torch.int32)
            return Int4Weight(qweight, scales, None, g_idx, group_size, 4)
        middle = 2 ** (bits - 1)
        zeros = torch.randint(middle - 2 * bits + 6, middle + 2 * bits - 5, (E, G, N), device=device).to(dtype)
        return Int4Weight(qweight, scales, zeros, None, group_size, bits)
    if kind.startswith("fp8"):  # codes of std ~64 times scales ~1/(64 sqrt K)
        codes = (torch.randn(E, N, K, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        shape = {"fp8": (E, -(-N // 128), -(-K // 128)), "fp8-channel": (E, N, 1), "fp8-tensor": (E,)}.get(kind)
        if shape is not None:
            scales = (torch.rand(shape, device=device) * 0.5 + 0.75) / (64 * K ** 0.5)
            return FP8Weight(codes, scales, block_size=(128, 128) if kind == "fp8" else None)
    if kind == "mxfp4":
        blocks = torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, device=device)
        center = 127 - round(torch.log2(torch.tensor(3 * K ** 0.5)).item())
        scales = torch.randint(center - 1, center + 2, (E, N, K // 32), device=device).to(torch.uint8)
        return MXFP4Weight(blocks, scales)
    raise ValueError(f"random_experts: kind {kind!r}; choose one of {EXPERT_KINDS}")
