"""The split-K sum inside the GEMM's own launch (`kernels.common.reduce_split_k`): at decode M the default
configs split K across programs; the last slice to arrive adds the slices' fp32 partials in slice order and
stores y in x's dtype. Against the torch references at odd shapes (N off the tiles), the same output run to
run, and the per-tile arrival counts back at 0 after every launch (the next launch of the plan reuses them).

Tolerances: the kernel families' own (tests/tolerances.py); the split only changes the fp32 summation order.
"""
import pytest
import tolerances
import torch

from tritonq.kernels.fp8_gemm import FP8Gemm, fp8_gemm_reference
from tritonq.kernels.int4_gemm import Int4Gemm, int4_gemm_reference
from tritonq.kernels.int8_gemm import Int8Gemm, int8_gemm_reference
from tritonq.random_weights import random_fp8_weight, random_int4_weight
from tritonq.quant.weights import W8A8Weight

N, K = 72, 1024  # N off the 64-wide tiles; K gives the decode defaults 2 (fp8, W8A8) to 4 (int4) slices


def assert_close(y, ref, family):
    tol = tolerances.table(family)[y.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def run_twice(gemm, x, **kwargs):
    """Two calls through the gemm's cached plan: outputs equal, arrival counts back at 0, K really split."""
    first, second = gemm(x, **kwargs), gemm(x, **kwargs)
    (plan,) = gemm.plans.values()
    assert plan.split_k > 1
    assert torch.equal(first, second)
    assert torch.equal(plan.launch.args["arrivals_ptr"], torch.zeros_like(plan.launch.args["arrivals_ptr"]))
    return first


def activations(M, dtype):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(M), device="cpu").to(
        device=torch.get_default_device(), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_int4(M, dtype):
    w = random_int4_weight(N, K, dtype, torch.get_default_device(), group_size=64)
    x = activations(M, dtype)
    assert_close(run_twice(Int4Gemm(w), x), int4_gemm_reference(x, w), "int4_gemm")


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_fp8(M, scheme):
    w = random_fp8_weight(N, K, scheme, torch.get_default_device())
    x = activations(M, torch.float16)  # the interpreter's bf16 dot is broken on the weight-only path
    for weight_only in (False, True):
        y = run_twice(FP8Gemm(w), x, weight_only=weight_only)
        assert_close(y, fp8_gemm_reference(x, w, weight_only), "fp8_gemm")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_w8a8(M, dtype):
    g = torch.Generator().manual_seed(N)
    device = torch.get_default_device()
    w = W8A8Weight(torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8, device="cpu").to(device),
                   (torch.rand(N, 1, generator=g, device="cpu") * 1e-2 + 1e-3).to(device))
    x = activations(M, dtype)
    assert_close(run_twice(Int8Gemm(w), x), int8_gemm_reference(x, w), "int8_gemm")
