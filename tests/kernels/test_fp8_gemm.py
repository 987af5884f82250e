"""fp8_gemm and quantize_activation_fp8 (Triton interpreter) against the torch references.

Tolerances, stated once:
* Activation quantization: exact. Kernel and reference do the same fp32 division and the
  same round-to-nearest-even into e4m3.
* Kernel vs the emulated reference (same quantized operands): products of e4m3 values are
  exact in fp32, so the two differ only in fp32 summation order, which can move a result
  across one rounding boundary of the output dtype: 1 ulp of x.dtype (rtol = eps), plus an
  atol of eps * max|y| for outputs that cancel to near zero. (The interpreter's fp32 -> bf16
  cast truncates instead of rounding to nearest: also within 1 ulp.) fp32 outputs have no final
  rounding, so the summation-order error itself is the bound: K * 2^-24 relative to the sum of
  |terms|, below 2^-14 of max|y| for these K and random data.
* Kernel vs the plain matmul with the dequantized weight and the unquantized x: e4m3 rounds
  each activation with relative error <= 2^-4, and these errors are independent, so the error
  of y relative to its norm stays below 2^-4.
The interpreter's bf16 tl.dot is broken (triton 3.9 returns garbage even for bf16 x bf16), so
the weight-only path, whose dot runs in x.dtype, is run with fp16 here; its bf16 variant is
the same code and is compiled for sm_80 below. The fp8 path's dot is e4m3 x e4m3 for every
x.dtype and is tested with bf16 and fp16 outputs.
"""
import logging
from dataclasses import replace

import pytest
import torch
import tolerances

from tritonq.kernels import common
from tritonq.kernels import fp8_gemm as fp8
from tritonq.kernels.fp8_gemm import (
    FP8GemmConfig,
    fp8_gemm,
    fp8_gemm_reference,
    quantize_activation_fp8,
    quantize_activation_fp8_reference,
)
from tritonq.random_weights import random_fp8_weight
from tritonq.quant.weights import FP8Weight

N, K = 200, 300  # neither a multiple of the 128 x 128 scale block nor of the kernel tiles


def make_weight(scheme: str, n: int = N, k: int = K, bias: bool = False) -> FP8Weight:
    """Random e4m3 weight with random positive scales of the given granularity, and a bf16 bias, on the test's
    device."""
    w = random_fp8_weight(n, k, scheme, torch.get_default_device())
    return replace(w, bias=torch.randn(n, dtype=torch.bfloat16)) if bias else w


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor) -> None:
    eps = tolerances.table("fp8_gemm")[out.dtype]
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=eps, atol=eps * ref.float().abs().max().item())


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("M", [1, 5, 64, 130])
def test_fp8_gemm_matches_reference(scheme, M):
    w = make_weight(scheme, bias=M == 5)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    out = fp8_gemm(x, w, weight_only=False)
    assert out.shape == (M, N)
    assert_matches_reference(out, fp8_gemm_reference(x, w))
    dense = x.float() @ w.dequantize().T + (w.bias if w.bias is not None else 0)
    assert (out.float() - dense).norm() / dense.norm() < 2 ** -4


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("M", [1, 64])
def test_weight_only_matches_reference(scheme, M):
    w = make_weight(scheme, bias=True)
    x = torch.randn(M, K, dtype=torch.float16)
    out = fp8_gemm(x, w, weight_only=True)
    assert_matches_reference(out, fp8_gemm_reference(x, w, weight_only=True))


@pytest.mark.parametrize("k", [K, K - 2])
def test_weight_only_decodes_words_or_bytes(k):
    """The weight-only path reads the e4m3 weight 4 bytes a word (common.e4m3_words_to_halves) where K is a multiple
    of 4, else byte by byte; both equal the reference, M = 3 over a split K with a ragged last tile."""
    w = make_weight("block", k=k, bias=True)
    x = torch.randn(3, k, dtype=torch.float16)
    config = FP8GemmConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=2)
    launch, out = fp8.fp8_gemm_launch(x, None, w, config, x.dtype)
    assert launch.args["WORD_DECODE"] == (k % 4 == 0)
    launch()
    assert_matches_reference(out, fp8_gemm_reference(x, w, weight_only=True))


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("weight_only", [False, True])
def test_split_k_matches_reference(scheme, weight_only):
    """K=300 in three slices of two 64-wide tiles (the last one ragged), bias added once."""
    w = make_weight(scheme, bias=True)
    x = torch.randn(3, K, dtype=torch.float16)
    config = FP8GemmConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SPLIT_K=3)
    out = fp8_gemm(x, w, weight_only=weight_only, config=config)
    assert_matches_reference(out, fp8_gemm_reference(x, w, weight_only=weight_only))


def test_default_decode_config_splits_k():
    assert fp8.default_config(1, 4096, 4096).SPLIT_K == 8  # 32 N tiles of 128 x 8 splits = 256 programs
    assert fp8.default_config(1, 4096, 4096, cc=75).SPLIT_K == 4  # 64 N tiles of 64 x 4 splits
    assert fp8.default_config(1, 2048, 7168).SPLIT_K == 14  # 56 K tiles: at least 4 a slice
    assert fp8.default_config(1, N, K).SPLIT_K == 1 and fp8.default_config(256, 4096, 4096).SPLIT_K == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_output_dtype_and_leading_dims(dtype):
    w = make_weight("channel")
    x = torch.randn(2, 3, K, dtype=dtype)
    out = fp8_gemm(x, w)
    assert out.shape == (2, 3, N) and out.dtype == dtype
    assert_matches_reference(out.reshape(6, N), fp8_gemm_reference(x.reshape(6, K), w))


@pytest.mark.parametrize("group_size", [None, 128])
def test_activation_quantization_matches_reference(group_size):
    x = torch.randn(17, K, dtype=torch.bfloat16) * torch.logspace(-3, 2, 17)[:, None]
    x[3] = 0  # an all-zero row: finite scale, zero codes
    q, scales = quantize_activation_fp8(x, group_size)
    q_ref, scales_ref = quantize_activation_fp8_reference(x, group_size)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == ((17, 1) if group_size is None else (17, 3))
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q.float(), q_ref.float())
    assert q[3].float().abs().max() == 0 and torch.isfinite(scales).all()
    # absmax scaling: each row's (group's) largest value maps to exactly +-448
    assert q.float().abs().amax(dim=1)[torch.arange(17) != 3].eq(448).all()


def test_activation_rounding_is_nearest_even_on_every_e4m3_interval():
    """Midpoints between neighbouring e4m3 values (ties, incl. carries into the next binade and
    the subnormal range) and points just beside them, quantized with a static scale of 1."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (values[1:] + values[:-1]) / 2
    x = torch.cat([mid, mid * (1 + 2 ** -20), mid * (1 - 2 ** -20), -mid, values]).reshape(1, -1)
    one = torch.tensor(1.0)
    q, _ = quantize_activation_fp8(x, input_scale=one)
    q_ref, _ = quantize_activation_fp8_reference(x, input_scale=one)
    assert torch.equal(q.float(), q_ref.float())
    # independent oracle for the ties: the neighbour whose code (mantissa lsb) is even
    lower = torch.arange(len(mid))
    even = values[torch.where(lower % 2 == 0, lower, lower + 1)]
    assert torch.equal(q.float()[0, :len(mid)], even)


def test_static_input_scale_saturates_at_448():
    """x / input_scale beyond +-448 saturates (no NaN from e4m3fn's overflow); weights at +-448."""
    w = make_weight("channel")
    codes = w.weight.float()
    codes[:, :4] = torch.tensor([448.0, -448.0, 448.0, -448.0])
    w = FP8Weight(codes.to(torch.float8_e4m3fn), w.weight_scale, input_scale=torch.tensor(0.01))
    x = torch.randn(5, K, dtype=torch.bfloat16) * 2
    x[:, 0], x[:, 1] = 100.0, -100.0  # 100 / 0.01 = 10^4, far past 448
    q, scale = quantize_activation_fp8(x, input_scale=w.input_scale)
    assert q.float()[:, 0].eq(448).all() and q.float()[:, 1].eq(-448).all() and scale.item() == pytest.approx(0.01)
    out = fp8_gemm(x, w)
    assert torch.isfinite(out.float()).all()
    assert_matches_reference(out, fp8_gemm_reference(x, w))


def test_zero_rows_give_bias():
    w = make_weight("block", bias=True)
    x = torch.randn(5, K, dtype=torch.bfloat16)
    x[[0, 3]] = 0
    out = fp8_gemm(x, w)
    assert torch.equal(out[[0, 3]], w.bias.expand(2, N))
    assert_matches_reference(out, fp8_gemm_reference(x, w))


def test_cpu_backend_runs_the_reference(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    w = make_weight("block")
    x = torch.randn(3, K, dtype=torch.float32)
    assert torch.equal(fp8_gemm(x, w), fp8_gemm_reference(x, w))


def test_weight_only_choice_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    common.has_fp8_tensor_cores.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=common.__name__):
            assert not common.has_fp8_tensor_cores(torch.device("cuda", 0))
            assert not common.has_fp8_tensor_cores(torch.device("cuda", 0))
        assert len(caplog.records) == 1 and "weight-only" in caplog.records[0].getMessage()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
        assert common.has_fp8_tensor_cores(torch.device("cuda", 1))
    finally:
        common.has_fp8_tensor_cores.cache_clear()


@pytest.mark.parametrize("bad, match", [
    (lambda w: FP8Weight(w.weight.to(torch.float16), w.weight_scale), "float8_e4m3fn"),
    (lambda w: FP8Weight(w.weight, torch.ones(2, 2), block_size=(128, 128)), r"expected \(2, 3\)"),
    (lambda w: FP8Weight(w.weight, torch.ones(7, 1)), "per channel"),
    (lambda w: FP8Weight(w.weight, w.weight_scale, input_scale=torch.ones(3)), "one value"),
])
def test_bad_weights_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        fp8_gemm(torch.randn(2, K), bad(make_weight("tensor")))


def test_block_k_straddling_a_scale_block_is_rejected():
    with pytest.raises(ValueError, match="BLOCK_K=256"):
        fp8_gemm(torch.randn(2, K), make_weight("block"), config=FP8GemmConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256))


def test_wrong_k_is_rejected():
    with pytest.raises(ValueError, match="K=299"):
        fp8_gemm(torch.randn(2, K - 1), make_weight("tensor"))


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block", "static"])
@pytest.mark.parametrize("M", [1, 3, 16])
def test_decode_quantizes_in_the_gemm_like_the_quantizer(scheme, M):
    """Up to 16 rows the GEMM quantizes x itself (one launch). Its numbers are the quantizer's: the same config
    fed `quantize_activation_fp8`'s codes and scales gives a bit-equal y, and y equals the reference. One outlier
    in the last K slice sets each row's scale: a program that took the absmax of its own slice only would
    quantize the other slices 100x finer. BLOCK_K 64 inside 128-wide scale groups: the group's absmax spans tiles."""
    w = make_weight("channel" if scheme == "static" else scheme, bias=True)
    if scheme == "static":
        w = replace(w, input_scale=torch.tensor(0.02))
    x = torch.randn(M, K, dtype=torch.bfloat16)
    x[:, K - 3] = 100.0
    config = FP8GemmConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, SPLIT_K=3)
    launch, y = fp8.fp8_gemm_launch(x, None, w, config, x.dtype, quantize=True)
    launch()
    group = w.block_size[1] if w.block_size is not None else None
    q, scales = quantize_activation_fp8(x, group, w.input_scale)
    launch_q, y_q = fp8.fp8_gemm_launch(q, scales, w, config, x.dtype)
    launch_q()
    assert torch.equal(y, y_q)
    assert_matches_reference(y, fp8_gemm_reference(x, w))
