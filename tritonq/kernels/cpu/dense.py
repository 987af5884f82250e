"""CPU backend for dense linears: bf16 on oneDNN over a weight reordered once, at load (torch's F.linear reorders
it on every call); small weights at one or two rows on the C loop of kernels/cpu/native.py (oneDNN's fixed cost per
call dominates there); in the batch-invariant mode every dense linear on that C loop. Measurements: docs/cpu.md.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tritonq.kernels import batch_invariant
from tritonq.kernels.cpu import native as cpu_native
from tritonq.quant.weights import DenseWeight

SMALL_WEIGHT = 1 << 18  # elements: weights up to this size also keep small_linear's copy for FEW_ROWS-row calls
FEW_ROWS = 2
PARALLEL_WORK = 1 << 20  # rows x weight elements from which a batch-invariant call runs on torch's threads


class Packed(NamedTuple):
    """A weight prepared once: onednn, the mkldnn tensor [N, K] (None in the batch-invariant mode); small, for a
    weight of at most SMALL_WEIGHT elements or any weight in the batch-invariant mode, its copy in
    cpu_native.small_linear_weight's layout (else None) and its bias in fp32 (None without one); out_features N."""
    onednn: torch.Tensor | None
    small: torch.Tensor | None
    small_bias: torch.Tensor | None
    out_features: int


_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # DenseWeight -> its Packed


def packs(w: DenseWeight) -> bool:
    """Whether `pack` applies: a 2-D bf16 CPU weight [N, K], oneDNN built into torch, native bf16; in the
    batch-invariant mode any 2-D fp32 / bf16 / fp16 CPU weight."""
    t = w.weight
    if t.device.type != "cpu" or t.dim() != 2:
        return False
    if batch_invariant():  # (tritonq.load checks that the C kernels are built)
        return t.dtype in cpu_native.DTYPES
    return (t.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


def pack(w: DenseWeight) -> Packed:
    """The packed form of w, made on the first call for this object: in the batch-invariant mode only the C loop's
    copy (every call runs it)."""
    p = _packed.get(w)
    if p is None:
        invariant = batch_invariant()
        small = invariant or w.weight.numel() <= SMALL_WEIGHT
        onednn = None if invariant else torch.ops.mkldnn._reorder_linear_weight(w.weight.contiguous(), None)
        p = _packed[w] = Packed(onednn, cpu_native.small_linear_weight(w.weight) if small else None,
                                w.bias.float() if small and w.bias is not None else None, w.weight.shape[0])
    return p


def linear(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias) in x's dtype (fp32 accumulation, one rounding), W packed by `pack`:
    oneDNN's bf16 GEMM, or cpu_native's small_linear over the small copy for at most FEW_ROWS rows, and for every
    call of a weight packed in the batch-invariant mode (each row's sums in k order whatever the other rows)."""
    rows = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()  # (a 2-D x: no reshape, no view)
    y = None
    if weight.onednn is None:
        y = cpu_native.small_linear(rows, weight.small, weight.out_features, weight.small_bias,
                                    parallel=rows.shape[0] * weight.small.numel() >= PARALLEL_WORK)
        if y is None:
            raise TypeError(f"a linear packed in the batch-invariant mode takes {weight.small.dtype} rows; got "
                            f"{rows.dtype} [{rows.shape[0]}, {rows.shape[1]}] with strides {rows.stride()}.")
    elif weight.small is not None and rows.shape[0] <= FEW_ROWS:
        y = cpu_native.small_linear(rows, weight.small, weight.out_features, weight.small_bias)
    if y is None:
        y = torch.ops.mkldnn._linear_pointwise(rows, weight.onednn, bias, "none", [], "")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])
