"""CPU backend for bf16 dense linears: oneDNN over a weight reordered once, at load.

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

Only bf16, on CPUs with native bf16 (AVX512-BF16 / AMX, `tritonq.loading.cpu_has_native_bf16`'s test):
fp32 stays on MKL ([K, N]-stored, tritonq.weights.k_major), fp16 has no AMX on these CPUs. The
packed copy is kept beside the plain weight (a tied embedding reads the plain table; the CUDA and
torch-reference paths read it too): bf16 linear weights take twice their bytes in host memory.
Under torch.compile (engine.compiled) the plain F.linear runs: the packed tensor (an opaque
mkldnn tensor) is not traced.

Small weights at one or two rows: oneDNN's bf16 call costs ~16-20 us whatever the size below ~256K elements
(measured on the 2-core box, M = 1: 128 x 256, 128 x 768, 384 x 128, 128 x 2048 in 16-19 us), where MKL's fp32
GEMV over the same values upcast takes 4-10 us, casts included 7-14 us; from M = 4, or above 256K elements
(1024 x 1024: 25 vs 48 us), oneDNN wins. So a weight of at most SMALL_WEIGHT elements also keeps an fp32 copy
([K, N]-stored, as fp32 models run; at most 1 MB each), which decode rows of at most FEW_ROWS take: bf16 inputs and
weights are exact in fp32 and the sum is rounded to bf16 once, as oneDNN's (only the summation order differs).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from tritonq.weights import DenseWeight

SMALL_WEIGHT = 1 << 18  # elements: weights up to this size also keep an fp32 copy for FEW_ROWS-row calls
FEW_ROWS = 2


class Packed(NamedTuple):
    """A bf16 weight prepared once: onednn, the mkldnn tensor [N, K]; small, for a weight of at most SMALL_WEIGHT
    elements, its fp32 copy [N, K] stored [K, N] (else None) and its bias in fp32 (None without one)."""
    onednn: torch.Tensor
    small: torch.Tensor | None
    small_bias: torch.Tensor | None


_packed: WeakIdKeyDictionary = WeakIdKeyDictionary()  # DenseWeight -> its Packed


def packs(w: DenseWeight) -> bool:
    """Whether `pack` applies: a 2-D bf16 CPU weight [N, K], oneDNN built into torch, native bf16."""
    t = w.weight
    return (t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2
            and torch.backends.mkldnn.is_available()
            and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


def pack(w: DenseWeight) -> Packed:
    """The packed form of w, made on the first call for this object."""
    p = _packed.get(w)
    if p is None:
        small = w.weight.numel() <= SMALL_WEIGHT
        p = _packed[w] = Packed(torch.ops.mkldnn._reorder_linear_weight(w.weight.contiguous(), None),
                                w.weight.float().t().contiguous().t() if small else None,
                                w.bias.float() if small and w.bias is not None else None)
    return p


def linear(x: torch.Tensor, weight: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias) in bf16 (fp32 accumulation, one rounding), W packed by `pack`:
    oneDNN's bf16 GEMM, or MKL's fp32 one over the small copy for at most FEW_ROWS rows."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if weight.small is not None and rows.shape[0] <= FEW_ROWS:
        y = F.linear(rows.float(), weight.small, weight.small_bias).to(torch.bfloat16)
    else:
        y = torch.ops.mkldnn._linear_pointwise(rows, weight.onednn, bias, "none", [], "")
    return y.view(*x.shape[:-1], y.shape[-1])
