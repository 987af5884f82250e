"""int4 GEMM benchmark: `python -m tritonq.bench int4_gemm [--dtype fp16] [--plot out.png]`.

For each weight shape (N=K=4096 and the Llama-2-7B / DeepSeek-V2-Lite linear layers) and each
M, times int4_gemm against a dense matmul of the same shape in the same run and reports time,
GB/s on the bytes actually moved (packed int4 + scales + zeros + activations + output),
TFLOP/s, % of the device roofline and the speedup. On CUDA the baseline is torch fp16/bf16
matmul. On CPU int4_gemm runs the CPU backend (kernels/cpu/lowbit.py; the torch reference with
TRITONQ_BACKEND=torch), compared with a float32 matmul: small shapes only, and the figures
describe that path, not the Triton kernel (the "backend" column says so).
"""
from __future__ import annotations

import argparse

import torch

from tritonq.bench.common import (CPU_GEMM_M, GEMM_M, MODELS, add_output_args, backend_label,
                                  model_gemm_shapes, parse_output_args, report_gemm, time_gemm)
from tritonq.random_weights import random_int4_weight
from tritonq.quant.weights import Int4Weight

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def int4_bytes(w: Int4Weight) -> int:
    """Bytes of the weight as the kernel reads it."""
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros) if t is not None)


def weight_shapes(models: list[str], square: int) -> list[tuple[str, int, int]]:
    shapes = [(f"N=K={square}", square, square)]
    for name in models:
        shapes += [(f"{name}.{layer}", N, K) for layer, N, K in model_gemm_shapes(MODELS[name])]
    return shapes


def run(ms: list[int], shapes: list[tuple[str, int, int]], dtype: torch.dtype, device: str) -> list[dict]:
    from tritonq.kernels.int4_gemm import int4_gemm

    rows, backend = [], backend_label(device)
    for label, N, K in shapes:
        w = random_int4_weight(N, K, dtype, device, group_size=128 if K % 128 == 0 else 64)
        dense = w.dequantize().to(dtype)  # [N, K]: the baseline multiplies the same weight dense
        rows += [row for _, row in time_gemm(label, ms, dense, lambda x: int4_gemm(x, w), int4_bytes(w), backend)]
        del dense
    return rows


def main(argv: list[str]) -> None:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m tritonq.bench int4_gemm", description=__doc__.split("\n")[0])
    p.add_argument("--m", default=",".join(map(str, GEMM_M if on_gpu else CPU_GEMM_M)),
                   help="comma-separated M values")
    p.add_argument("--square", type=int, default=4096 if on_gpu else 512, help="N=K of the square shape")
    p.add_argument("--models", default=",".join(MODELS) if on_gpu else "",
                   help=f"comma-separated subset of {list(MODELS)} (default: all on GPU, none on CPU)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp16",
                   help="activation/scale dtype on GPU (CPU always computes in float32)")
    add_output_args(p, "int4_gemm")
    args = parse_output_args(p, argv)
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(MODELS)
    if unknown:
        p.error(f"unknown --models {sorted(unknown)}; choose from {list(MODELS)}")
    dtype = DTYPES[args.dtype] if on_gpu else torch.float32
    device = "cuda" if on_gpu else "cpu"
    baseline = f"torch {args.dtype} matmul" if on_gpu else "torch float32 matmul (CPU)"
    rows = run([int(m) for m in args.m.split(",")], weight_shapes(models, args.square), dtype, device)
    report_gemm("int4_gemm", rows, baseline, dtype, args, argv)
