"""y [..., N] = x [..., K] @ W^T (+ bias) for every weight type: one table, `LINEARS`, from the weight's type to
(prepare once, run per call), for the GPU and the CPU backend alike.

`prepare(w)` runs once per weight (a Linear's construction): it checks the weight, so a bad one fails there with
its kernel's message, and builds what the calls need: the weight's GEMM object (`Int4Gemm`, `FP8Gemm`, `Int8Gemm`,
`GGUFGemm`: kernel, config and launch arguments resolved once per M bucket, one launch per call at decode) and, on
the CPU backend, the CPU form (kernels/cpu/lowbit.py's repacked int4 or dequantized weight, cpu_dense's oneDNN-packed bf16
one). `run(x, prepared)` is then a lookup and a call: the backend (CPU kernels, the torch reference under
TRITONQ_BACKEND=torch, Triton) is picked from x by the GEMM object, or by the CPU fast paths here. A `PartsWeight`
(a fused linear whose parts keep different types) runs each part's row and concatenates the outputs.

`prepare_gate_up(w)` is the SwiGLU MLP's gate_up linear with its activation in the GEMM's epilogue (one launch
instead of the GEMM and a silu_mul kernel): where the weight runs a Triton GEMM with that epilogue (int4/int8
weight-only, fp8 per tensor / channel, W8A8), its rows are interleaved once, gate row i then up row i, so that every
output tile holds the gate and up columns of the same intermediate units, and its GEMM object stores silu(g) * u.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from tritonq.kernels import backend
from tritonq.kernels.cpu import dense as cpu_dense, lowbit as cpu_lowbit
from tritonq.kernels.dense_gemm import DenseGemm
from tritonq.kernels.fp8_gemm import FP8Gemm
from tritonq.kernels.gguf_gemm import GGUFGemm
from tritonq.kernels.int4_gemm import Int4Gemm
from tritonq.kernels.int8_gemm import Int8Gemm
from tritonq.quant.weights import DenseWeight, FP8Weight, GGUFWeight, Int4Weight, PartsWeight, W8A8Weight, Weight


@dataclass(frozen=True)
class Prepared:
    """What `prepare` made of one weight: the weight, its GEMM object (None for dense weights; a PartsWeight: each
    part's (run, Prepared)) and its CPU form (None off the CPU backend, for W8A8 weights, which run as stored, and
    for dense weights oneDNN does not pack)."""
    weight: Weight
    gemm: Any
    cpu: Any


@dataclass(frozen=True)
class LinearKind:
    prepare: Callable[[Weight], Prepared]
    run: Callable[[torch.Tensor, Prepared], torch.Tensor]


def _prepare_dense(w: DenseWeight) -> Prepared:
    return Prepared(w, DenseGemm(w), cpu_dense.pack(w) if backend(w.weight) == "cpu" and cpu_dense.packs(w) else None)


def _dense(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    if p.cpu is not None and backend(x) == "cpu" and not torch.compiler.is_compiling():
        return cpu_dense.linear(x, p.cpu, p.weight.bias)  # a compiled step traces F.linear
    # cuBLAS (F.linear), or in the batch-invariant mode one Triton config for every M (cuBLAS picks its kernel by M)
    return p.gemm(x)


def _prepare_int4(w: Int4Weight) -> Prepared:
    gemm = Int4Gemm(w)  # it holds the CPU form (the weight repacked once): one CPU route
    return Prepared(gemm.w, gemm, None)  # its weight: an act-order one sorted for the kernel, held once


def _int4(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    """Int4Weight and GGUFWeight: [..., K] through the GEMM object (which runs its own CPU form)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = p.gemm(x2)
    return y.view(*x.shape[:-1], y.shape[-1])


def _prepare_fp8(w: FP8Weight) -> Prepared:
    # the CPU form (the weight dequantized once) is made now, at load; FP8Gemm finds it on every call
    return Prepared(w, FP8Gemm(w), cpu_lowbit.prepare(w) if backend(w.weight) == "cpu" else None)


def _prepare_w8a8(w: W8A8Weight) -> Prepared:
    return Prepared(w, Int8Gemm(w), None)  # the CPU backend runs the int8 codes as stored (torch._int_mm)


def _prepare_gguf(w: GGUFWeight) -> Prepared:
    return Prepared(w, GGUFGemm(w), None)  # GGUFGemm holds the CPU form (the C GGUF linear's): one CPU route


def _gemm(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    return p.gemm(x)  # FP8Gemm and Int8Gemm take [..., K] themselves


def _prepare_parts(w: PartsWeight) -> Prepared:
    return Prepared(w, tuple((kind_of(part).run, kind_of(part).prepare(part)) for part in w.parts), None)


def _parts(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    """A fused linear of parts of different types: each part's GEMM, outputs concatenated along N."""
    return torch.cat([run(x, prepared) for run, prepared in p.gemm], dim=-1)




# The one table of linears by weight type (MXFP4 is experts-only: kernels/moe/).
LINEARS = {
    DenseWeight: LinearKind(_prepare_dense, _dense),
    Int4Weight: LinearKind(_prepare_int4, _int4),
    FP8Weight: LinearKind(_prepare_fp8, _gemm),
    W8A8Weight: LinearKind(_prepare_w8a8, _gemm),
    GGUFWeight: LinearKind(_prepare_gguf, _int4),
    PartsWeight: LinearKind(_prepare_parts, _parts),
}


# The quantized weight types whose GEMM kernel has the SwiGLU epilogue (`common.store_output`), by their GEMM object.
_GATED_GEMMS = {Int4Weight: Int4Gemm, FP8Weight: FP8Gemm, W8A8Weight: Int8Gemm}


def prepare_gate_up(w: Weight) -> Prepared | None:
    """The fused gate_up weight w [2I, K] (gate rows, then up rows) prepared to run silu(x @ gate^T) * (x @ up^T)
    [..., I] as one GEMM (the module docstring); `run(x, prepared)` of w's table row then returns that. None where
    no Triton GEMM with the epilogue runs w: the CPU backend (its kernels, then norm_rope.silu_mul), fp8 with block
    scales (a scale covers a block of rows, which the interleave would split). A dense weight keeps its order:
    `dense_gemm.DenseGemm` reads the pairs by row index (and runs cuBLAS, then silu_mul, for prefill)."""
    if backend(w.values) != "triton" or w.shape[0] % 2 or (isinstance(w, FP8Weight) and w.block_size is not None):
        return None
    if isinstance(w, DenseWeight):
        return Prepared(w, DenseGemm(w, silu_mul=True), None)
    gemm = _GATED_GEMMS.get(type(w))
    if gemm is None:
        return None
    inter = w.shape[0] // 2
    pairs = torch.stack([torch.arange(inter), torch.arange(inter, 2 * inter)], dim=1).flatten()
    w = w.take_outputs(pairs)  # rows gate 0, up 0, gate 1, up 1, ...
    gated = gemm(w, silu_mul=True)
    return Prepared(gated.w, gated, None)  # the GEMM's weight (int4: sorted where act-order)


def kind_of(w: Weight) -> LinearKind:
    """The table's row for w's type; TypeError naming the types it has otherwise."""
    kind = LINEARS.get(type(w))
    if kind is None:
        raise TypeError(f"a linear layer needs one of {[t.__name__ for t in LINEARS]}; got {type(w).__name__} "
                        "(MXFP4 weights run as MoE experts only)")
    return kind
