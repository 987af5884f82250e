"""int8_gemm and quantize_activation_int8 (Triton interpreter, or the GPU) against the torch references, and the
CPU backend (torch._int_mm) against the same reference.

Tolerances (tests/tolerances.py, "int8_gemm"):
* Activation quantization: exact. Kernel and reference do the same IEEE fp32 division and round half to even.
* Kernel vs the reference on the same int8 codes: the int8 x int8 dot is exact in int32 on both sides, so
  they differ only in the fp32 epilogue order, the split-K sum of partials and the output rounding: 1 ulp of
  the output dtype (rtol = eps, atol = eps * max|y|).
* Kernel vs the plain matmul with the dequantized weight and the unquantized x (an independent check of the
  int8 rounding): each activation moves by at most half a step, |x - x_hat| <= scale / 2 (scale = absmax /
  127.5 per token; the largest value maps to 127.5 and is clamped to 127, also half a step), so
  |y - x @ W_hat^T| <= scale / 2 * sum_k |W_hat[n, k]| per element, plus the output rounding.
"""
from dataclasses import replace

import pytest
import torch
import tolerances

from tritonq.kernels.int8_gemm import (
    DYNAMIC_DIVISOR,
    Int8GemmConfig,
    int8_gemm,
    int8_gemm_launch,
    int8_gemm_reference,
    quantize_activation_int8,
    quantize_activation_int8_reference,
)
from tritonq.quant.weights import W8A8Weight

N, K = 200, 300  # off every tile (16 / 32 / 64 / 128)


def make_weight(n: int = N, k: int = K, per_channel: bool = True, static: bool = False, asymmetric: bool = False,
                bias: bool = False, device=None) -> W8A8Weight:
    """Random int8 codes over the whole range with random positive scales, drawn on the CPU (a seeded CPU
    generator) and moved to `device` (None: the test's device, torch's default)."""
    device = device or torch.get_default_device()
    g = torch.Generator().manual_seed(n * k)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8, device="cpu")
    scale = (torch.rand(n, 1, generator=g, device="cpu") * 1e-2 + 1e-3 if per_channel
             else torch.tensor(4e-3, device="cpu"))
    w = W8A8Weight(codes.to(device), scale.to(device),
                   input_scale=torch.tensor(0.02, device=device) if static or asymmetric else None,
                   input_zero_point=torch.tensor(-7, dtype=torch.int32, device=device) if asymmetric else None)
    return replace(w, bias=torch.randn(n, generator=g, device="cpu").to(device=device, dtype=torch.bfloat16)) if bias else w


def activations(M: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """[M, K] activations drawn on the CPU and moved to `device` (None: the test's device)."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M), device="cpu") * 1.5
    x[0, 3] = 9.0  # past the static grid (0.02 * 127 = 2.54): clamped
    return x.to(device=device or torch.get_default_device(), dtype=dtype)


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    eps = tolerances.table("int8_gemm")[out.dtype]
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=eps, atol=eps * ref.float().abs().max().item())


SCHEMES = {"dynamic": {}, "static": dict(static=True), "asymmetric": dict(asymmetric=True)}


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_activation_codes_equal_the_reference(scheme, M):
    w = make_weight(**SCHEMES[scheme])
    x = activations(M, torch.float16)
    q, scales = quantize_activation_int8(x, w.input_scale, w.input_zero_point)
    q_ref, scales_ref = quantize_activation_int8_reference(x, w.input_scale, w.input_zero_point)
    assert q.dtype == torch.int8 and torch.equal(q.cpu(), q_ref.cpu())
    assert torch.equal(scales.cpu(), scales_ref.cpu())


def test_activation_rounding_is_half_to_even_and_clamped():
    """compressed-tensors clamps to [-128, 127] and rounds with torch.round (half to even): worked by hand."""
    x = torch.tensor([[0.5, 1.5, 2.5, -2.5, 3.49, 300.0, -300.0, 0.0]])
    q, _ = quantize_activation_int8(x, torch.tensor(1.0))
    assert q.cpu().tolist() == [[0, 2, 2, -2, 3, 127, -128, 0]]
    q, _ = quantize_activation_int8(x, torch.tensor(1.0), torch.tensor(-5, dtype=torch.int32))
    assert q.cpu().tolist() == [[-4, -4, -2, -8, -2, 127, -128, -5]]  # round(x + z), z = -5: -4.5, -3.5, -2.5 to even
    q, scales = quantize_activation_int8(torch.tensor([[-127.5, 63.5, 62.5, 0.25]]))  # dynamic: absmax / 127.5 = 1
    assert scales.cpu().tolist() == [1.0] and q.cpu().tolist() == [[-128, 64, 62, 0]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_int8_gemm_matches_reference(M, scheme, dtype):
    w = make_weight(per_channel=scheme != "static", bias=M == 3, **SCHEMES[scheme])
    x = activations(M, dtype)
    assert_matches_reference(int8_gemm(x, w), int8_gemm_reference(x, w))


@pytest.mark.parametrize("config", [Int8GemmConfig(16, 32, 32, 1, SPLIT_K=3), Int8GemmConfig(32, 64, 64, 2),
                                    Int8GemmConfig(64, 128, 128, 8, SPLIT_K=2)])
@pytest.mark.parametrize("fp16_dot", [False, True])
def test_int8_gemm_configs_match_reference(config, fp16_dot):
    """Split-K planes, grouped ordering and tiles wider than N's remainder, asymmetric with a bias (every
    epilogue term per slice); fp16_dot: sm_75's dot of the int8 codes in fp16 (exact products, fp32 sums)."""
    w = make_weight(asymmetric=True, bias=True)
    x = activations(17, torch.float16)
    assert_matches_reference(int8_gemm(x, w, config=config, fp16_dot=fp16_dot), int8_gemm_reference(x, w))


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_whole_k_tiles_match_reference(scheme):
    """K = 384, a multiple of BLOCK_K = 64: every K tile is whole and the loads are not masked along K (EVEN_K), over
    4 slices of two tiles (the last one empty), M = 3 quantized in the GEMM, with a bias."""
    k = 384
    w = make_weight(k=k, per_channel=scheme != "static", bias=True, **SCHEMES[scheme])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3), device="cpu").to(torch.get_default_device())
    config = Int8GemmConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SPLIT_K=4)
    launch, y = int8_gemm_launch(x, None, w, config, x.dtype)
    assert launch.args["EVEN_K"]
    launch()
    assert_matches_reference(y, int8_gemm_reference(x, w))


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("M", [1, 3, 16])
def test_decode_quantizes_in_the_gemm_like_the_quantizer(scheme, M):
    """Up to 16 rows the GEMM quantizes x itself (one launch), to the quantizer's codes: the same config fed
    `quantize_activation_int8`'s codes and scales gives a bit-equal y, and y equals the reference. One outlier in
    the last K slice sets each row's scale: a program that took the absmax of its own slice only would quantize
    the other slices 25x finer."""
    w = make_weight(per_channel=scheme != "static", bias=True, **SCHEMES[scheme])
    x = activations(M, torch.bfloat16)
    x[:, K - 3] = 40.0
    config = Int8GemmConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SPLIT_K=3)
    launch, y = int8_gemm_launch(x, None, w, config, x.dtype)
    launch()
    q, scales = quantize_activation_int8(x, w.input_scale, w.input_zero_point)
    launch_q, y_q = int8_gemm_launch(q, scales, w, config, x.dtype)
    launch_q()
    assert torch.equal(y, y_q)
    assert_matches_reference(y, int8_gemm_reference(x, w))


@pytest.mark.parametrize("M", [1, 17])
def test_int8_gemm_error_is_within_int8_rounding(M):
    """Against the plain fp32 matmul with the dequantized weight and the unquantized x (module docstring)."""
    w = make_weight()
    x = activations(M)
    y = int8_gemm(x, w).float()
    w_hat = w.dequantize()
    exact = x.float() @ w_hat.T
    step = x.float().abs().amax(dim=1, keepdim=True) / DYNAMIC_DIVISOR
    bound = step / 2 * w_hat.abs().sum(dim=1)[None, :]
    assert ((y - exact).abs() <= bound * (1 + 1e-5) + 1e-5 * exact.abs().max()).all()
    assert (y - exact).abs().max() > 0  # the activations were rounded at all


def test_int8_gemm_keeps_leading_dims_and_refuses_bad_input():
    w = make_weight()
    x = activations(6).view(2, 3, K)
    assert int8_gemm(x, w).shape == (2, 3, N)
    with pytest.raises(ValueError, match=r"x has K=299 columns but the weight is \[N=200, K=300\]"):
        int8_gemm(x[..., :299], w)
    with pytest.raises(ValueError, match="W8A8Weight.weight must be a 2-D int8"):
        int8_gemm(x, replace(w, weight=w.weight.to(torch.int16)))
    with pytest.raises(ValueError, match="input_zero_point must be one integer and comes with a static input_scale"):
        int8_gemm(x, replace(w, input_zero_point=torch.tensor(3, dtype=torch.int32, device=w.weight.device)))


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("M", [1, 3, 17, 64])
def test_cpu_int_mm_path_matches_reference(monkeypatch, M, scheme):
    """The CPU backend (outside the interpreter): torch._int_mm on the same codes is exact like the reference."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITONQ_BACKEND", "auto")
    w = make_weight(bias=True, device="cpu", **SCHEMES[scheme])
    for dtype in (torch.float32, torch.bfloat16):
        x = activations(M, dtype, device="cpu")
        assert_matches_reference(int8_gemm(x, w), int8_gemm_reference(x, w))
