"""y [..., N] = x [..., K] @ W^T (+ bias) for every weight type: one table, `LINEARS`, from the weight's type to
(prepare once, run per call), for the GPU and the CPU backend alike.

`prepare(w)` runs once per weight (a Linear's construction): it checks the weight, so a bad one fails there with
its kernel's message, and builds what the calls need: the weight's GEMM object (`Int4Gemm`, `FP8Gemm`, `Int8Gemm`:
kernel, config and launch arguments resolved once per M bucket, one launch per call at decode) and, on the CPU
backend, the CPU form (kernels/cpu/lowbit.py's repacked int4 or dequantized weight, cpu_dense's oneDNN-packed bf16
one). `run(x, prepared)` is then a lookup and a call: the backend (CPU kernels, the torch reference under
TRITONQ_BACKEND=torch, Triton) is picked from x by the GEMM object, or by the CPU fast paths here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tritonq.kernels import backend, batch_invariant
from tritonq.kernels.cpu import dense as cpu_dense, lowbit as cpu_lowbit
from tritonq.kernels.dense_gemm import dense_gemm
from tritonq.kernels.fp8_gemm import FP8Gemm
from tritonq.kernels.int4_gemm import Int4Gemm
from tritonq.kernels.int8_gemm import Int8Gemm
from tritonq.quant.weights import DenseWeight, FP8Weight, Int4Weight, W8A8Weight, Weight


@dataclass(frozen=True)
class Prepared:
    """What `prepare` made of one weight: the weight, its GEMM object (None for dense weights) and its CPU form
    (None off the CPU backend, for W8A8 weights, which run as stored, and for dense weights oneDNN does not pack)."""
    weight: Weight
    gemm: Any
    cpu: Any


@dataclass(frozen=True)
class LinearKind:
    prepare: Callable[[Weight], Prepared]
    run: Callable[[torch.Tensor, Prepared], torch.Tensor]


def _prepare_dense(w: DenseWeight) -> Prepared:
    return Prepared(w, None, cpu_dense.pack(w) if backend(w.weight) == "cpu" and cpu_dense.packs(w) else None)


def _dense(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    b = backend(x)
    if p.cpu is not None and b == "cpu" and not torch.compiler.is_compiling():
        return cpu_dense.linear(x, p.cpu, p.weight.bias)  # a compiled step traces F.linear
    if batch_invariant() and b == "triton":  # cuBLAS picks its kernel by M: one Triton config for every M instead
        return dense_gemm(x, p.weight)
    return F.linear(x, p.weight.weight, p.weight.bias)  # bf16 on the CPU backend: cpu_dense above


def _prepare_int4(w: Int4Weight) -> Prepared:
    return Prepared(w, Int4Gemm(w), None)  # Int4Gemm holds the CPU form (the weight repacked once)


def _int4(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    y = p.gemm(x.reshape(-1, x.shape[-1]))  # Int4Gemm takes [M, K]
    return y.view(*x.shape[:-1], y.shape[-1])


def _prepare_fp8(w: FP8Weight) -> Prepared:
    # the CPU form (the weight dequantized once) is made now, at load; FP8Gemm finds it on every call
    return Prepared(w, FP8Gemm(w), cpu_lowbit.prepare(w) if backend(w.weight) == "cpu" else None)


def _prepare_w8a8(w: W8A8Weight) -> Prepared:
    return Prepared(w, Int8Gemm(w), None)  # the CPU backend runs the int8 codes as stored (torch._int_mm)


def _gemm(x: torch.Tensor, p: Prepared) -> torch.Tensor:
    return p.gemm(x)  # FP8Gemm and Int8Gemm take [..., K] themselves


# The one table of linears by weight type (MXFP4 is experts-only: kernels/moe/).
LINEARS = {
    DenseWeight: LinearKind(_prepare_dense, _dense),
    Int4Weight: LinearKind(_prepare_int4, _int4),
    FP8Weight: LinearKind(_prepare_fp8, _gemm),
    W8A8Weight: LinearKind(_prepare_w8a8, _gemm),
}


def kind_of(w: Weight) -> LinearKind:
    """The table's row for w's type; TypeError naming the types it has otherwise."""
    kind = LINEARS.get(type(w))
    if kind is None:
        raise TypeError(f"a linear layer needs one of {[t.__name__ for t in LINEARS]}; got {type(w).__name__} "
                        "(MXFP4 weights run as MoE experts only)")
    return kind
