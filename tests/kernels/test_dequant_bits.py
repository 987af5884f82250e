"""The magic-number dequantization (`common.dequantize_int_tile`) is exact for every code and zero.

The kernels build (q - zero) * scale without int-to-float conversion: the code ORed into the mantissa of
1024.0 (fp16), 128.0 (bf16, codes < 128) or 2^23 (fp32), then one subtraction of magic + zero and one
multiply. The claim is bit equality with the fp32 reference ((q - zero) * scale in fp32, rounded once to the
output dtype), for all 4- and 8-bit codes and zeros, symmetric and asymmetric. The fp16 and fp32 paths run
here in Triton's interpreter; the bf16 path runs only on a GPU (the interpreter computes on bitcast bf16 as
raw bits, so there bf16 takes the fp32 path), so its arithmetic is checked in torch's bf16, which rounds
each operation once to nearest-even like the GPU's HADD2.BF16 / HMUL2.BF16.
"""
import pytest
import torch
import triton
import triton.language as tl

from tritonq.kernels.common import dequantize_int_tile


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, z_ptr, out_ptr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                       ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    w = dequantize_int_tile(tl.load(q_ptr + offs), tl.load(s_ptr + offs), tl.load(z_ptr + offs), BITS, HAS_ZEROS,
                            out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, w)


def every_code_and_zero(bits: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Codes and zeros covering every (q, zero) pair of `bits` (4 bits: all 256; 8 bits: every q against 16
    zeros spread over 0..255, and every zero against 16 q's), with random scales over 5 binades."""
    n = 1 << bits
    if bits == 4:
        q, z = torch.cartesian_prod(torch.arange(n), torch.arange(n)).T
    else:
        spread = torch.arange(0, n, 17)[:16]
        a = torch.cartesian_prod(torch.arange(n), spread).T
        q, z = torch.cat([a[0], a[1]]), torch.cat([a[1], a[0]])
    scale = (2.0 ** torch.empty(q.numel()).uniform_(-9, -4)).to(scale_dtype)
    return q.to(torch.int32), scale, z.to(scale_dtype)


def reference(q, scale, zero, bits, has_zeros, dtype):
    zero = zero.float() if has_zeros else 2.0 ** (bits - 1)
    return ((q.float() - zero) * scale.float()).to(dtype)


@pytest.mark.parametrize("dtype, scale_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                                (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("has_zeros", [True, False])
def test_dequantize_int_tile_is_exact_for_every_code(dtype, scale_dtype, bits, has_zeros):
    q, scale, zero = every_code_and_zero(bits, scale_dtype)
    cols = 16
    q, scale, zero = (t.reshape(-1, cols).contiguous() for t in (q, scale, zero))
    out = torch.empty(q.shape, dtype=dtype)
    _dequantize_kernel[(1,)](q, scale, zero, out, bits, has_zeros, q.shape[0], cols)
    expected = reference(q, scale, zero, bits, has_zeros, dtype)
    if dtype == torch.bfloat16:
        # The interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest: its bf16 differs from
        # the reference by at most one bf16 ulp (the GPU's cast rounds; the GPU's bf16 path is the next test).
        ulp = expected.float().abs() * 2.0 ** -7
        assert ((out.float() - expected.float()).abs() <= ulp).all()
    else:
        assert torch.equal(out, expected), (out - expected).abs().max()


@pytest.mark.parametrize("has_zeros", [True, False])
def test_bf16_magic_number_arithmetic_is_exact(has_zeros):
    """The GPU's bf16 path: 0x4300 | q read as bf16 is 128 + q, and (h - (zero + 128)) * scale in bf16 is the
    reference, for every 4-bit code and zero (bits <= 7 take this path; 8-bit codes run in fp32)."""
    q, scale, zero = every_code_and_zero(4, torch.bfloat16)
    h = (q | 0x4300).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(h.float(), q.float() + 128)
    z = zero + 128.0 if has_zeros else torch.tensor(128.0 + 8, dtype=torch.bfloat16)
    assert torch.equal((h - z) * scale, reference(q, scale, zero, 4, has_zeros, torch.bfloat16))
