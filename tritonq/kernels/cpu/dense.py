"""CPU backend for dense linears: bf16 on oneDNN over a weight reordered once, at load; all on a C loop in the
batch-invariant mode.

torch's bf16 `F.linear` on CPU calls oneDNN too, but with the plain [N, K] weight, which oneDNN
reorders into its blocked AMX / AVX512-BF16 layout again on every call: for a decode step's few
rows that reorder is most of the GEMM. `pack(w)` reorders once (`torch.ops.mkldnn._reorder_linear_weight`,
what inductor's freezing pass does) and `linear` runs `torch.ops.mkldnn._linear_pointwise` on it
(vLLM's CPU build does the same through its own `onednn_mm` handle). The same kernel: outputs are
F.linear's within one bf16 rounding (the summation order is oneDNN's choice per CPU and batch size, so
neither bit equality with F.linear nor batch invariance is promised; tests/kernels/test_cpu_dense.py).

Measured (one core of the shared 2-core Sapphire Rapids box, load 14-18, thread CPU time, min of
15), F.linear vs packed, ms: 2048 x 1024, M = 1: 0.31-0.37 vs 0.19; M = 32: 0.38-0.45 vs 0.23-0.26;
M = 256: 1.2 vs 1.0. 5632 x 1024: M = 1: 0.76-0.94 vs 0.49-0.55; M = 32: 1.0-1.5 vs 0.57-0.80;
M = 256: 11.7-20 vs 3.0-7.7. Prefill-sized M (1024-2048) measured within the noise of each other.

Only bf16, on CPUs with native bf16 (AVX512-BF16 / AMX, `tritonq.api.load.cpu_has_native_bf16`'s test):
fp32 stays on MKL ([K, N]-stored, tritonq.quant.weights.k_major), fp16 has no AMX on these CPUs. The
packed copy is kept beside the plain weight (a tied embedding reads the plain table; the CUDA and
torch-reference paths read it too): bf16 linear weights take twice their bytes in host memory.
Under torch.compile (engine.compiled) the plain F.linear runs: the packed tensor (an opaque
mkldnn tensor) is not traced.

Small weights at one or two rows: oneDNN's bf16 call costs ~15-25 us whatever the size below ~256K elements (a
decode step of a small model is mostly such calls), so a weight of at most SMALL_WEIGHT elements also keeps a k-major
bf16 copy that calls of at most FEW_ROWS rows run through cpu_native's small_linear (one C loop, float32 sums in
registers, one rounding, as oneDNN's; only the summation order differs). Measured here (AMD EPYC, 2 cores, AVX-512,
min of 5 x 600 calls, call included), oneDNN vs the C loop, us: 256 x 128, M = 1: 22 vs 8; 768 x 128: 17 vs 8;
128 x 384: 16 vs 6; 2048 x 128: 20 vs 17 (M = 2: 23 vs 18); from M = 4 on the larger of these, or 1024 x 1024 at
M = 1 (36 vs 55), oneDNN wins. So outside the batch-invariant mode a row's bf16 result depends on how many rows share
the call (the C loop at 1-2, oneDNN above, each with its own summation order): within one bf16 rounding.

Batch-invariant mode (kernels.batch_invariant(), on while the model is built and run; docs/batch_invariance.md): every
CPU dense linear, fp32 / bf16 / fp16 and of any size, keeps only the C loop's k-major copy and runs it at every row
count (one multiply-add chain per output in k order, whatever the other rows; blocks of rows and columns shared by
torch's threads from PARALLEL_WORK on). fp32 leaves MKL too, whose blocking also changes a row's sums with the row
count (from M = 5 on at 1024 x 1024 here). Its cost is docs/batch_invariance.md's.
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
