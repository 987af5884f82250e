"""The bf16 dense linear over a weight packed once for oneDNN (kernels/cpu/dense.py) against the fp32
product of the same bf16 values (x and W are exact in fp32, so the only error is the output's one
rounding to bf16 after fp32 accumulation: half an ulp, plus summation order; checked at one ulp, eps)
and against torch's own F.linear and its own rows run alone, within that same one bf16 rounding: both are
fp32 sums of the same products rounded once, and only the summation order may differ (oneDNN picks its
blocking per CPU and batch size, so bit equality would hold on this CPU only); M = 0, 1, 3, 33, 300 rows;
K and N not multiples of the kernel's blocks."""
import pytest
import torch
import torch.nn.functional as F

from tritonq.kernels.cpu import dense as cpu_dense, native as cpu_native
from tritonq.formats.layers import Linear
from tritonq.quant.weights import DenseWeight

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and (
                  torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())),
                  reason="packed bf16 linears need oneDNN and a CPU with AVX512-BF16 or AMX")]
N, K = 200, 328
EPS = torch.finfo(torch.bfloat16).eps


def assert_one_bf16_rounding_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    """Two bf16 results of the same fp32-accumulated products: at most one bf16 ulp apart."""
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got.float(), want.float(), rtol=EPS, atol=EPS * scale)


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)


def weight(bias: bool) -> DenseWeight:
    g = torch.Generator().manual_seed(0)
    return DenseWeight(torch.randn(N, K, generator=g).bfloat16(),
                       torch.randn(N, generator=g).bfloat16() if bias else None)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M", [0, 1, 3, 33, 300])
def test_packed_linear_matches_fp32_product_and_equals_f_linear(M, bias):
    w = weight(bias)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
    got = cpu_dense.linear(x, cpu_dense.pack(w), w.bias)
    ref = x.float() @ w.weight.float().T + (w.bias.float() if bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    torch.testing.assert_close(got.float(), ref, rtol=EPS, atol=EPS * float(ref.abs().max()) if M else 0)
    assert_one_bf16_rounding_apart(got, F.linear(x, w.weight, w.bias))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(200, 328), (2049, 130)])
def test_few_rows_take_the_small_copy_of_small_weights_only(n, k, bias, monkeypatch):
    """A weight of at most SMALL_WEIGHT elements keeps small_linear's copy, which 1 and 2 rows run on (the C loop); a
    larger one (2049 x 130) keeps none and runs oneDNN. Either way the fp32 product of the bf16 values, rounded once."""
    g = torch.Generator().manual_seed(n)
    w = DenseWeight(torch.randn(n, k, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16() if bias else None)
    p = cpu_dense.pack(w)
    assert (p.small is not None) == (n * k <= cpu_dense.SMALL_WEIGHT) and (p.small_bias is not None) == (
        bias and p.small is not None)
    small = []  # rows of the calls that took the small copy
    run = cpu_native.small_linear
    monkeypatch.setattr(cpu_native, "small_linear", lambda x, *a: small.append(x.shape[0]) or run(x, *a))
    for M in (1, 2, 3):
        x = torch.randn(M, k, generator=g).bfloat16()
        got = cpu_dense.linear(x, p, w.bias)
        ref = x.float() @ w.weight.float().T + (w.bias.float() if bias else 0)
        assert got.dtype == torch.bfloat16 and got.shape == (M, n)
        torch.testing.assert_close(got.float(), ref, rtol=EPS, atol=EPS * float(ref.abs().max()))
    assert small == ([1, 2] if p.small is not None else [])


def test_packed_linear_rows_do_not_depend_on_the_batch_and_keep_leading_dims():
    w = weight(bias=True)
    p = cpu_dense.pack(w)
    x = torch.randn(2, 37, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    batch = cpu_dense.linear(x, p, w.bias)
    assert batch.shape == (2, 37, N)
    for row in (0, 5, 36):
        assert_one_bf16_rounding_apart(cpu_dense.linear(x[1, row:row + 1], p, w.bias)[0], batch[1, row])


def test_linear_packs_bf16_weights_on_the_cpu_backend_only(monkeypatch):
    """Linear packs a bf16 weight at construction and runs the packed GEMM; fp32 weights and
    TRITONQ_BACKEND=torch (the reference backend) keep F.linear over the plain weight."""
    calls = []
    run = cpu_dense.linear
    monkeypatch.setattr(cpu_dense, "linear", lambda *a: calls.append(1) or run(*a))
    x = torch.randn(4, K).bfloat16()
    bf16 = Linear(weight(bias=True))
    assert bf16.prepared.cpu is not None
    assert_one_bf16_rounding_apart(bf16(x), F.linear(x, bf16.weight.weight, bf16.weight.bias))
    assert calls == [1]
    fp32 = Linear(DenseWeight(torch.randn(N, K)))
    assert fp32.prepared.cpu is None
    fp32(x.float())
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    reference = Linear(weight(bias=False))
    assert reference.prepared.cpu is None
    reference(x)
    assert calls == [1]


@pytest.mark.parametrize("M", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("n, k", [(1, 1), (63, 17), (64, 128), (200, 328), (129, 5)])
def test_small_linear_is_the_fp32_product_rounded_once(M, n, k):
    """cpu_native.small_linear (the C loop small weights take at few rows) at any row count (blocks of 4 rows and a
    remainder), N off its 64-column block (zero-padded weight), x a strided view, with and without a bias: the fp32
    product of the bf16 values, rounded once. fp32 x is not taken."""
    g = torch.Generator().manual_seed(M * n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    x = torch.randn(M, k + 3, generator=g).bfloat16()[:, 2:k + 2]
    packed = cpu_native.small_linear_weight(w)
    assert packed.shape == (k, -(-n // 64) * 64) and not packed[:, n:].any()
    for b in (None, bias):
        got = cpu_native.small_linear(x, packed, n, b)
        ref = x.float() @ w.float().T + (0 if b is None else b)
        assert got.dtype == torch.bfloat16 and got.shape == (M, n)
        torch.testing.assert_close(got.float(), ref, rtol=EPS, atol=EPS * float(ref.abs().max()))
    assert cpu_native.small_linear(x.float(), packed, n, None) is None
