"""SwiGLU in the gate_up GEMM's epilogue (kernels/linear.py prepare_gate_up, common.store_output): the int4, fp8
(per tensor / channel) and W8A8 GEMMs over the interleaved weight, and the dense Triton GEMM reading the pairs by row
index (dense_gemm.DenseGateUp, M <= 16; larger M: cuBLAS then silu_mul), return silu(gate) * up [M, I], equal to a
float32 torch reference of the stored (gate rows, then up rows) weight: its dequantized GEMM, then SwiGLU.
M = 1, 3 (split-K decode paths), 17, 64 (tiled paths); I = 100 (N = 200) is off every tile.

Tolerance: each GEMM family's own bound (tests/tolerances.py) on gate and on up, relative to max |gate_up|,
carried through the product: |d(silu(g) u)| <= 1.1 |u| |dg| + |silu(g)| |du| (silu' <= 1.1), so
atol = 3 tol max|gate_up|^2, and rtol = tol for the one rounding of the result.
"""
from dataclasses import replace

import pytest
import tolerances
import torch
import torch.nn.functional as F

from tritonq.kernels.fp8_gemm import fp8_gemm_reference
from tritonq.kernels.int8_gemm import int8_gemm_reference
from tritonq.kernels.linear import prepare_gate_up
from tritonq.layers import GateUpLinear
from tritonq.random_weights import random_fp8_weight, random_int4_weight
from tritonq.weights import DenseWeight, W8A8Weight

INTER, K = 100, 256


def int8_weight(n: int, k: int) -> W8A8Weight:
    g = torch.Generator().manual_seed(n + k)
    return W8A8Weight(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8),
                      torch.rand(n, 1, generator=g) * 1e-2 + 1e-3)


# name -> (weight [2I, K], the family's fp32 reference GEMM of x as fp32, tolerance family)
WEIGHTS = {
    "int4": (lambda: random_int4_weight(2 * INTER, K, torch.bfloat16, "cpu", group_size=64),
             lambda x, w: x.float() @ w.dequantize(torch.float32).t(), "int4_gemm"),
    "int4-bias": (lambda: replace(random_int4_weight(2 * INTER, K, torch.float16, "cpu", group_size=128),
                                  bias=torch.randn(2 * INTER, dtype=torch.float16)),
                  lambda x, w: x.float() @ w.dequantize(torch.float32).t() + w.bias.float(), "int4_gemm"),
    "fp8-tensor": (lambda: random_fp8_weight(2 * INTER, K, "tensor", "cpu"),
                   lambda x, w: fp8_gemm_reference(x.float(), w), "fp8_gemm"),
    "fp8-channel": (lambda: random_fp8_weight(2 * INTER, K, "channel", "cpu"),
                    lambda x, w: fp8_gemm_reference(x.float(), w), "fp8_gemm"),
    "w8a8": (lambda: int8_weight(2 * INTER, K), lambda x, w: int8_gemm_reference(x.float(), w), "int8_gemm"),
    # bf16 weights meet bf16 x in the dot, fp32 sums, one rounding: int4_gemm's bound (its dequantized weight is
    # the same kind of operand)
    "dense-bias": (lambda: DenseWeight(torch.randn(2 * INTER, K, dtype=torch.bfloat16) * 0.05,
                                       torch.randn(2 * INTER, dtype=torch.bfloat16)),
                   lambda x, w: x.float() @ w.weight.float().t() + w.bias.float(), "int4_gemm"),
}


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_fused_gate_up_matches_reference(name, M):
    make, reference, family = WEIGHTS[name]
    torch.manual_seed(M)
    w = make()
    dtype = torch.float16 if name == "int4-bias" else torch.bfloat16
    x = torch.randn(M, K, dtype=dtype)
    linear = GateUpLinear(w)
    assert linear.fused and linear.out_features == INTER
    y = linear(x)
    assert y.shape == (M, INTER) and y.dtype == dtype
    gate_up = reference(x, w)  # the stored weight, gate rows then up rows
    tol = tolerances.table(family)[dtype]
    torch.testing.assert_close(y.float(), swiglu_reference(gate_up), rtol=tol,
                               atol=3 * tol * gate_up.abs().max().item() ** 2)


def test_block_scaled_fp8_runs_unfused():
    """A block-scaled fp8 gate_up (a scale spans 128 rows, which the interleave would split) keeps the stored order
    and runs the GEMM, then silu_mul; the result is SwiGLU all the same."""
    x = torch.randn(3, K, dtype=torch.bfloat16)
    w = random_fp8_weight(2 * INTER, K, "block", "cpu")
    assert prepare_gate_up(w) is None
    linear = GateUpLinear(w)
    assert not linear.fused and linear.weight is w
    gate_up = fp8_gemm_reference(x.float(), w)
    tol = tolerances.table("fp8_gemm")[torch.bfloat16]
    torch.testing.assert_close(linear(x).float(), swiglu_reference(gate_up), rtol=tol,
                               atol=3 * tol * gate_up.abs().max().item() ** 2)


def test_cpu_backend_runs_unfused(monkeypatch):
    """Without the interpreter a CPU weight runs the CPU backend's kernels (no Triton GEMM): nothing is
    interleaved, the layer is the GEMM, then silu_mul."""
    monkeypatch.delenv("TRITON_INTERPRET")
    w = random_int4_weight(2 * INTER, K, torch.bfloat16, "cpu", group_size=64)
    linear = GateUpLinear(w)
    assert not linear.fused and linear.weight is w
    x = torch.randn(3, K, dtype=torch.bfloat16)
    gate_up = x.float() @ w.dequantize(torch.float32).t()
    tol = 2 ** -7  # torch's int4 CPU kernel rounds gate_up to bf16 before silu_mul
    torch.testing.assert_close(linear(x).float(), swiglu_reference(gate_up), rtol=tol,
                               atol=3 * tol * gate_up.abs().max().item() ** 2)


def test_torch_backend_applies_swiglu_after_the_reference(monkeypatch):
    """TRITONQ_BACKEND=torch over an interleaved weight: the GEMM object's reference path does the epilogue's
    SwiGLU in torch, so the layer's output does not depend on the backend."""
    w = random_int4_weight(2 * INTER, K, torch.bfloat16, "cpu", group_size=64)
    linear = GateUpLinear(w)
    x = torch.randn(3, K, dtype=torch.bfloat16)
    fused = linear(x)
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    torch.testing.assert_close(linear(x).float(), fused.float(), rtol=2 ** -7, atol=2 ** -7 * fused.abs().max().item())


def test_odd_gate_up_is_refused_by_the_gemm():
    from tritonq.kernels.int4_gemm import Int4Gemm
    w = random_int4_weight(2 * INTER, K, torch.bfloat16, "cpu").take_outputs(torch.arange(2 * INTER - 1))
    with pytest.raises(ValueError, match="even for silu_mul"):
        Int4Gemm(w, silu_mul=True)
