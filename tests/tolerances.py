"""One tolerance table per dtype for the kernel tests (and so for `python -m tritonq.check`, which runs
them on the GPU), each entry with its reason.

An entry bounds ours - reference for one kernel family whose output is in that dtype, against a
float32 (rms_norm: float64) reference; the tests use it as rtol and atol (int4_gemm and fp8_gemm:
atol = tol * max|reference|, for outputs that cancel to near zero). Ulps: fp32 2^-24, fp16 2^-11,
bf16 2^-8 relative (half the machine epsilon).
"""
import torch

TOLERANCE = {
    torch.float32: {
        # Same dequantized operands and an exact (ieee) fp32 dot: summation order over K only.
        "int4_gemm": 2 ** -11,
        # Products of e4m3 values are exact in fp32: summation order, K * 2^-24 of sum |terms|.
        "fp8_gemm": 2 ** -14,
        # Summation order, and exp2 (the kernels) vs exp (the references).
        "attention": 1e-4,
        # Exact fp32 dots: summation order only.
        "moe": 1e-4,
        # One fp32 rounding of mean(x^2), rsqrt and the product, against float64.
        "rms_norm": 1e-5,
        # Tiny models end to end (two layers, logits; relative to max|logit|): summation order in every
        # GEMM and attention, carried through norms and residuals.
        "model": 1e-3,
        # Realistic shapes on the GPU (relative to max|ref|): K up to 4224 fp32 terms per output.
        "large": 1e-3,
    },
    torch.float16: {
        # The dequantized weight meets x in fp16 on the tensor cores and y is rounded once: 2 ulps.
        "int4_gemm": 2 ** -10,
        # fp32 summation order can move y across one rounding boundary of fp16: 1 ulp (eps).
        "fp8_gemm": torch.finfo(torch.float16).eps,
        # Probabilities rounded to fp16 before the PV dot (as every flash kernel), output rounded once.
        "attention": 4e-3,
        # x, the dequantized weights and the SiLU-and-mul hidden each rounded to fp16 before a GEMM.
        "moe": 2e-2,
        # The output rounded to fp16 at |y| up to ~4.
        "rms_norm": 1e-3,
        # Tiny models end to end in fp16 against the fp32 CPU path: every activation rounded to fp16
        # (2^-11) through two layers.
        "model": 5e-2,
        # Realistic shapes on the GPU (relative to max|ref|): fp16 rounding of the output, of the
        # dequantized weight or attention probabilities, plus K-long fp32 accumulation.
        "large": 1e-2,
    },
    torch.bfloat16: {
        # As fp16 with bf16's 8-bit mantissa: 2 ulps.
        "int4_gemm": 2 ** -7,
        # As fp16: 1 ulp (eps) of bf16.
        "fp8_gemm": torch.finfo(torch.bfloat16).eps,
        # As fp16, 8x coarser (probabilities rounded to bf16 before the PV dot, output rounded once).
        "attention": 3e-2,
        # As fp16, 8x coarser (8-bit mantissa).
        "moe": 5e-2,
        # As fp16 with bf16's 8-bit mantissa (2^-8 per rounding).
        "large": 3e-2,
    },
}


def table(family: str) -> dict:
    """{dtype: tolerance} of one kernel family."""
    return {dtype: row[family] for dtype, row in TOLERANCE.items() if family in row}
