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
from tritonq.formats.layers import GateUpLinear
from tritonq.random_weights import random_fp8_weight, random_int4_weight
from tritonq.quant.weights import DenseWeight, W8A8Weight

INTER, K = 100, 256


def int8_weight(n: int, k: int, device) -> W8A8Weight:
    g = torch.Generator().manual_seed(n + k)  # drawn on the CPU, then moved: the same weight on any device
    return W8A8Weight(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8, device="cpu").to(device),
                      (torch.rand(n, 1, generator=g, device="cpu") * 1e-2 + 1e-3).to(device))


# name -> (device -> weight [2I, K], the family's fp32 reference GEMM of x as fp32, tolerance family)
WEIGHTS = {
    "int4": (lambda d: random_int4_weight(2 * INTER, K, torch.bfloat16, d, group_size=64),
             lambda x, w: x.float() @ w.dequantize(torch.float32).t(), "int4_gemm"),
    "int4-bias": (lambda d: replace(random_int4_weight(2 * INTER, K, torch.float16, d, group_size=128),
                                    bias=torch.randn(2 * INTER, dtype=torch.float16, device=d)),
                  lambda x, w: x.float() @ w.dequantize(torch.float32).t() + w.bias.float(), "int4_gemm"),
    "fp8-tensor": (lambda d: random_fp8_weight(2 * INTER, K, "tensor", d),
                   lambda x, w: fp8_gemm_reference(x.float(), w), "fp8_gemm"),
    "fp8-channel": (lambda d: random_fp8_weight(2 * INTER, K, "channel", d),
                    lambda x, w: fp8_gemm_reference(x.float(), w), "fp8_gemm"),
    "w8a8": (lambda d: int8_weight(2 * INTER, K, d), lambda x, w: int8_gemm_reference(x.float(), w), "int8_gemm"),
    # bf16 weights meet bf16 x in the dot, fp32 sums, one rounding: int4_gemm's bound (its dequantized weight is
    # the same kind of operand)
    "dense-bias": (lambda d: DenseWeight(torch.randn(2 * INTER, K, dtype=torch.bfloat16, device=d) * 0.05,
                                         torch.randn(2 * INTER, dtype=torch.bfloat16, device=d)),
                   lambda x, w: x.float() @ w.weight.float().t() + w.bias.float(), "int4_gemm"),
}


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("M", [1, 3, 17, 64])
@pytest.mark.parametrize("name", list(WEIGHTS))
def test_fused_gate_up_matches_reference(name, M, device):
    make, reference, family = WEIGHTS[name]
    torch.manual_seed(M)
    w = make(device)
    dtype = torch.float16 if name == "int4-bias" else torch.bfloat16
    x = torch.randn(M, K, dtype=dtype, device=device)
    linear = GateUpLinear(w)
    assert linear.fused and linear.out_features == INTER
    y = linear(x)
    assert y.shape == (M, INTER) and y.dtype == dtype
    gate_up = reference(x, w)  # the stored weight, gate rows then up rows
    tol = tolerances.table(family)[dtype]
    torch.testing.assert_close(y.float(), swiglu_reference(gate_up), rtol=tol,
                               atol=3 * tol * gate_up.abs().max().item() ** 2)


def test_block_scaled_fp8_runs_unfused(device):
    """A block-scaled fp8 gate_up (a scale spans 128 rows, which the interleave would split) keeps the stored order
    and runs the GEMM, then silu_mul; the result is SwiGLU all the same."""
    x = torch.randn(3, K, dtype=torch.bfloat16, device=device)
    w = random_fp8_weight(2 * INTER, K, "block", device)
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


# The residual + RMSNorm epilogue of a decode step's o_proj (Linear.add_norm, common.add_rms_norm_tile): N = 200 is
# off the column tiles, so a row's norm gathers several tiles' partial sums; K = 1024 splits K at decode for the
# quantized GEMMs (the norm after the split-K sum, in the same launch); M 1, 3, 16 (the decode bound) fused, 17 not.
NORM_N, NORM_K = 200, 1024
ADD_NORM_WEIGHTS = {
    "int4": (lambda dtype, d: random_int4_weight(NORM_N, NORM_K, dtype, d, group_size=64),
             lambda x, w: x.float() @ w.dequantize(torch.float32).t(), "int4_gemm"),
    "fp8-tensor": (lambda dtype, d: random_fp8_weight(NORM_N, NORM_K, "tensor", d),
                   lambda x, w: fp8_gemm_reference(x.float(), w).float(), "fp8_gemm"),
    "fp8-channel-bias": (lambda dtype, d: replace(random_fp8_weight(NORM_N, NORM_K, "channel", d),
                                                  bias=torch.randn(NORM_N, dtype=dtype, device=d)),
                         lambda x, w: fp8_gemm_reference(x.float(), w).float(), "fp8_gemm"),
    "fp8-block": (lambda dtype, d: random_fp8_weight(NORM_N, NORM_K, "block", d),
                  lambda x, w: fp8_gemm_reference(x.float(), w).float(), "fp8_gemm"),
    "w8a8": (lambda dtype, d: int8_weight(NORM_N, NORM_K, d), lambda x, w: int8_gemm_reference(x.float(), w).float(),
             "int8_gemm"),
    "dense-bias": (lambda dtype, d: DenseWeight(torch.randn(NORM_N, NORM_K, dtype=dtype, device=d) * 0.05,
                                                torch.randn(NORM_N, dtype=dtype, device=d)),
                   lambda x, w: x.float() @ w.weight.float().t() + w.bias.float(), "int4_gemm"),
}


@pytest.mark.parametrize("M", [1, 3, 16, 17])
@pytest.mark.parametrize("name", list(ADD_NORM_WEIGHTS))
def test_add_norm_epilogue_matches_reference(name, M, device):
    """y = x @ W^T + residual and h = RMSNorm(y) * w, against float32 torch: y within the GEMM's bound plus one
    rounding of the sum; h computed from our y (the norm of the stored residual stream, as the unfused kernel
    normalizes the sum it stored), in fp32 over each whole row, within one bf16 rounding (fp16's is smaller). The fused launch runs
    up to 16 rows (split over K for the quantized weights), the GEMM and then the norm's kernel past them."""
    from tritonq.formats.layers import Linear, RMSNorm
    make, reference, family = ADD_NORM_WEIGHTS[name]
    torch.manual_seed(M)
    # fp16 past 16 rows: the interpreter adds bf16 as raw bits in _rms_norm_kernel (its GPU sum is right)
    dtype = torch.bfloat16 if M <= 16 else torch.float16
    w = make(dtype, device)
    x = torch.randn(M, NORM_K, dtype=dtype, device=device)
    residual = torch.randn(M, NORM_N, dtype=dtype, device=device)
    norm = RMSNorm(torch.rand(NORM_N, dtype=dtype, device=device) + 0.5, 1e-6)
    linear = Linear(w)
    gemm = linear.prepared.gemm
    fused = gemm.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert (fused is not None) == (M <= 16)
    if fused is not None and name != "dense-bias":  # the plan's launch took the split-K path
        assert [p.split_k for k, p in gemm.plans.items() if "add_rms_norm" in k][0] > 1
    y, h = linear.add_norm(x, residual, norm)
    assert y.shape == h.shape == (M, NORM_N) and y.dtype == h.dtype == dtype
    expected = reference(x, w) + residual.float()
    tol = tolerances.table(family)[dtype]
    torch.testing.assert_close(y.float(), expected, rtol=2 ** -8, atol=tol * expected.abs().max().item())
    yf = y.float()
    h_ref = yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    torch.testing.assert_close(h.float(), h_ref, rtol=2 ** -8, atol=2 ** -8 * h_ref.abs().max().item())


def test_add_norm_runs_gemm_then_norm_past_decode_rows(device):
    """Past the decode bound (M 17) the GEMM has no such epilogue: Linear.add_norm is the GEMM, then add_rms_norm,
    with the same results up to the norm's summation order."""
    from tritonq.kernels.norm_rope import add_rms_norm
    from tritonq.formats.layers import Linear, RMSNorm
    # fp16: the interpreter adds bf16 as raw bits in _rms_norm_kernel (its GPU sum is right)
    w = random_int4_weight(200, K, torch.float16, device, group_size=64)
    linear, norm = Linear(w), RMSNorm(torch.rand(200, dtype=torch.float16, device=device) + 0.5, 1e-6)
    x = torch.randn(17, K, dtype=torch.float16, device=device)
    residual = torch.randn(17, 200, dtype=torch.float16, device=device)
    assert linear.prepared.gemm.add_rms_norm(x, residual, norm.weight, norm.eps) is None
    y, h = linear.add_norm(x, residual, norm)
    y_ref, h_ref = add_rms_norm(residual, linear(x), norm.weight, norm.eps)
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
