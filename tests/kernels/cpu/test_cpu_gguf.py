"""The C GGUF linear (kernels/cpu/csrc/linear.c's tritonq_gguf_linear through native.gguf_linear) against a float32
matmul on the gguf package's own dequantization of the same random blocks (tests/formats/gguf_files.py: every code
and sub-block scale, fp16 d / dmin of both signs), every block format GGUFWeight keeps, at M = 1, 3 (the 4-row
blocks), 17, 64 (the 8-row blocks, 17 with a partial one) and N = 200 (not a multiple of either column block; a
wide N = 1100 too), K off the 256-weight super-blocks where the format allows (Q4_1 / Q5_x / IQ4_NL: 32-weight
blocks).

The kernel forms each weight's value exactly as the gguf package does (its products are exact in float32), so only
the summation order differs from the reference: rtol 1e-5, atol 1e-5 * max |ref| (float32 sums of a few hundred
terms). Then the same bits: a row of M = 17 (and 64) equals its M = 1 run, two threads equal one, and the generic
build (-mno-avx512f: a CPU without AVX-512) equals the AVX-512 one; a weight the kernel cannot take is refused.
"""
import platform
from dataclasses import replace

import pytest
import torch

from formats.gguf_files import random_weight
from tritonq.kernels.cpu import native as cpu_native

TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K"]
SMALL_BLOCKS = {"Q4_1", "Q5_0", "Q5_1", "IQ4_NL"}  # 32-weight blocks: K need not be a multiple of 256
MS = [1, 3, 17, 64]
N = 200


def case(type_name: str, K: int | None = None, seed: int = 0):
    """(GGUFWeight with a bias, the gguf package's fp32 W [N, K]) for K off the super-blocks where allowed."""
    K = K or (352 if type_name in SMALL_BLOCKS else 512)
    w, W = random_weight(type_name, N, K, seed=seed)
    return replace(w, bias=torch.randn(N, generator=torch.Generator().manual_seed(seed))), W


def assert_fp32_close(y, ref):
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("type_name", TYPES)
def test_matches_float32_matmul_on_the_gguf_values_and_rows_do_not_depend_on_the_batch(type_name):
    w, W = case(type_name)
    x = torch.randn(max(MS), W.shape[1])
    alone = cpu_native.gguf_linear(x[16:17].contiguous(), w)
    for M in MS:
        y = cpu_native.gguf_linear(x[:M], w)
        assert y.shape == (M, N) and y.dtype == torch.float32
        assert_fp32_close(y, x[:M] @ W.t() + w.bias)
        if M > 16:
            assert torch.equal(y[16], alone[0]), f"row 16 of M = {M} differs from its M = 1 run"


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_a_wide_weight_in_column_chunks(type_name):
    """N = 1100: items of several 64-column blocks (up to 512 columns, about four a thread), the last one partial."""
    w, W = random_weight(type_name, 1100, 256, seed=3)
    x = torch.randn(17, 256)
    y = cpu_native.gguf_linear(x, w)
    assert_fp32_close(y, x @ W.t())
    assert torch.equal(cpu_native.gguf_linear(x[5:6].contiguous(), w)[0], y[5])


def test_rows_of_a_wider_tensor_and_no_bias():
    w, W = case("Q6_K")
    rows = torch.randn(5, 2 * W.shape[1])[:, :W.shape[1]]  # a view: rows 2K apart
    assert_fp32_close(cpu_native.gguf_linear(rows, replace(w, bias=None)), rows @ W.t())


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="-mno-avx512f is an x86 flag")
def test_the_same_bits_on_two_threads_and_without_avx512(fresh_library, monkeypatch):
    """Items are whole blocks of rows and columns, each output one multiply-add chain in k order with the same
    weight values: two threads, and the generic loop of a build without AVX-512, give the same bits."""
    cases = {t: case(t, seed=1) for t in TYPES}
    xs = {M: torch.randn(M, 512) for M in (1, 17)}
    before = torch.get_num_threads()
    got = {}
    for t, (w, _) in cases.items():
        for M, x in xs.items():
            x = x[:, :w.shape[1]].contiguous()
            got[t, M] = cpu_native.gguf_linear(x, w)
            torch.set_num_threads(2)
            try:
                assert torch.equal(cpu_native.gguf_linear(x, w, parallel=True), got[t, M]), (t, M)
            finally:
                torch.set_num_threads(before)
    monkeypatch.setattr(cpu_native, "FLAGS", [*cpu_native.FLAGS, "-mno-avx512f"])
    cpu_native.library.cache_clear()
    for t, (w, W) in cases.items():
        for M, x in xs.items():
            x = x[:, :w.shape[1]].contiguous()
            assert torch.equal(cpu_native.gguf_linear(x, w), got[t, M]), (t, M)


def test_a_weight_outside_the_kernel_is_refused_before_any_work():
    w, _ = case("Q6_K")
    x = torch.randn(2, w.shape[1])
    with pytest.raises(ValueError, match="zero 3.*power of two"):
        cpu_native.gguf_linear(x, replace(w, zero=3))
    with pytest.raises(ValueError, match="scales is a torch.float16 tensor.*float32"):
        cpu_native.gguf_linear(x, replace(w, scales=w.scales.half()))
    assert cpu_native.gguf_linear(x.double(), w) is None  # not float32 rows: the caller's torch path


def test_without_the_c_library_a_gguf_weight_runs_an_fp32_copy(monkeypatch):
    """No C compiler: the weight is dequantized once to float32 (the gguf package's values) and runs MKL."""
    from tritonq.kernels.cpu import lowbit as cpu_lowbit
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    w, W = case("Q5_K")
    p = cpu_lowbit.prepare(w)
    assert isinstance(p, cpu_lowbit.CPUDenseWeight) and torch.equal(p.weight, W)
    x = torch.randn(3, W.shape[1])
    assert_fp32_close(cpu_lowbit.linear(x, p), x @ W.t() + w.bias)
