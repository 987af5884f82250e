"""Typed weights: what a format loader hands to the model, whatever the checkpoint format.

Shapes use the linear-layer notation y = x @ W^T with W [N, K] (N outputs, K inputs).
These are frozen dataclasses; `tritonq.layers.Linear` picks the kernel from the type.
The safetensors access class `Weights` and the `WeightsLoader` interface live here too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DenseWeight:
    """weight [N, K] fp16/bf16/fp32; bias [N] or None."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        return self.weight


@dataclass(frozen=True)
class Int4Weight:
    """Integer weights in tritonq's one internal layout (both AWQ and GPTQ are repacked into it).

    qweight [K * bits / 32, N] int32: packed along K, sequential order: row r, field i holds
            input row k = r * (32 // bits) + i, bits (4 or 8) wide, at bit offset i * bits.
    scales  [G, N] fp16/bf16, G = number of groups along K.
    zeros   [G, N] same dtype as scales, integer-valued (already unpacked, v1 offset removed),
            or None for symmetric weights (zero = 2^(bits-1)).
    g_idx   [K] int32 group of each input row (act-order), or None: group of row k = k // group_size.
    group_size: rows per group (K for per-channel quantization).
    Dequant: W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n].
    """
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    group_size: int
    bits: int = 4
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[1], self.qweight.shape[0] * 32 // self.bits)

    def dequantize(self) -> torch.Tensor:
        from tritonq.kernels.int4_gemm import dequantize_int4
        return dequantize_int4(self)


@dataclass(frozen=True)
class FP8Weight:
    """weight [N, K] float8_e4m3fn.

    weight_scale: fp32, shape [] (per tensor), [N, 1] (per output channel) or, with block_size
    (bn, bk), [ceil(N/bn), ceil(K/bk)] (DeepSeek-V3 `weight_scale_inv`): W = weight * scale.
    input_scale: fp32 [] for static activation scaling, or None for dynamic per-token scaling.
    """
    weight: torch.Tensor
    weight_scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        from tritonq.kernels.fp8_gemm import dequantize_fp8
        return dequantize_fp8(self)


Weight = DenseWeight | Int4Weight | FP8Weight
