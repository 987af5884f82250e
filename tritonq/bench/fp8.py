"""FP8 GEMM benchmark: `python -m tritonq.bench fp8 [--scheme block,channel] [--weight-only] [--plot out.png]`.

For N=K=4096 and the DeepSeek-V3 shapes (N=7168, K=2048 and N=2048, K=7168), each M and each
weight-scale scheme, times fp8_gemm (activation quantization included) against bf16
`torch.matmul` with the same (dequantized) weight in the same run, and reports time, GB/s on
the bytes moved (fp8 weight + scales + bf16 activations in + output out), TFLOP/s, % of the
device roofline (fp8 peak) and the speedup. Per-channel rows also time torch._scaled_mm
(cuBLASLt, row-wise scales) on the same quantized operands, column `scaled_mm_ms` (M % 16 == 0).
On CPU fp8_gemm runs the CPU backend (kernels/cpu/lowbit.py; the torch reference with
TRITONQ_BACKEND=torch) against a float32 matmul: small shapes only, and the figures describe
that path, not the Triton kernel (the "backend" column says so).
"""
from __future__ import annotations

import argparse

import torch

from tritonq.bench.common import add_output_args, backend_label, parse_output_args, report_gemm, time_gemm, time_ms
from tritonq.random_weights import random_fp8_weight
from tritonq.quant.weights import FP8Weight

GPU_M = (1, 16, 128, 1024, 4096)
CPU_M = (1, 16, 64)
GPU_SHAPES = (("N=K=4096", 4096, 4096), ("dsv3 N=7168,K=2048", 7168, 2048), ("dsv3 N=2048,K=7168", 2048, 7168))
CPU_SHAPES = (("N=K=512", 512, 512),)


def fp8_bytes(w: FP8Weight) -> int:
    return w.weight.numel() + w.weight_scale.numel() * 4


def scaled_mm_ms(x: torch.Tensor, w: FP8Weight) -> float:
    """cuBLASLt fp8 GEMM with row-wise scales on our quantized activations (matmul only)."""
    from tritonq.kernels.fp8_gemm import quantize_activation_fp8
    xq, xs = quantize_activation_fp8(x)
    w_t, ws = w.weight.T, w.weight_scale.reshape(1, -1)
    return time_ms(lambda: torch._scaled_mm(xq, w_t, scale_a=xs, scale_b=ws, out_dtype=x.dtype))


def run(ms: list[int], shapes, schemes: list[str], weight_only: bool, dtype: torch.dtype, device: str) -> list[dict]:
    from tritonq.kernels.fp8_gemm import fp8_gemm

    on_gpu = device == "cuda"
    backend = backend_label(device) + (" weight-only" if weight_only else " fp8 x fp8")
    rows = []
    for label, N, K in shapes:
        for scheme in schemes:
            w = random_fp8_weight(N, K, scheme, device)
            dense = w.dequantize().to(dtype)  # the baseline multiplies the same weight dense
            run = lambda x: fp8_gemm(x, w, weight_only=weight_only)  # noqa: E731
            for x, row in time_gemm(f"{label} {scheme}", ms, dense, run, fp8_bytes(w), backend,
                                  fp8=not weight_only):
                if on_gpu and scheme == "channel" and not weight_only and row["M"] % 16 == 0:  # cuBLASLt: M % 16 == 0
                    row["scaled_mm_ms"] = scaled_mm_ms(x, w)
                rows.append(row)
            del dense
    return rows


def main(argv: list[str]) -> None:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m tritonq.bench fp8", description=__doc__.split("\n")[0])
    p.add_argument("--m", default=",".join(map(str, GPU_M if on_gpu else CPU_M)), help="comma-separated M values")
    p.add_argument("--scheme", default="block,channel", help="comma-separated subset of tensor,channel,block")
    p.add_argument("--weight-only", action="store_true",
                   help="time the weight-only path (what GPUs below sm_89 run) instead of fp8 x fp8")
    add_output_args(p, "fp8")
    args = parse_output_args(p, argv)
    schemes = [s for s in args.scheme.split(",") if s]
    unknown = set(schemes) - {"tensor", "channel", "block"}
    if unknown:
        p.error(f"unknown --scheme {sorted(unknown)}; choose from tensor, channel, block")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    device = "cuda" if on_gpu else "cpu"
    baseline = "torch bf16 matmul" if on_gpu else "torch float32 matmul (CPU)"
    rows = run([int(m) for m in args.m.split(",")], GPU_SHAPES if on_gpu else CPU_SHAPES, schemes,
               args.weight_only, dtype, device)
    report_gemm("fp8", rows, baseline, dtype, args, argv)
