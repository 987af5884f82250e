"""Fused MoE vs the loop-over-experts reference (and vLLM's fused_moe if importable).

DeepSeek-V2-Lite shapes by default: 64 experts, top-6, hidden 2048, moe_intermediate 1408,
bf16 activations; dense bf16, int4 (group 128, asymmetric) or fp8 (128x128 block) experts.
All candidates run side by side in one process on the same inputs and routing.
    python -m tritonq.bench moe [--tokens 1 16 256 4096] [--weights dense int4 fp8] [--out FILE]
"""
from __future__ import annotations

import argparse

import torch

from tritonq.bench.common import device_peaks, print_table, time_ms, write_json
from tritonq.kernels.moe import fused_moe, fused_moe_reference, grouped_topk
from tritonq.random_weights import random_experts


def _vllm_fused_moe():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
        return fused_experts
    except Exception:  # not installed, or no GPU build
        return None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--weights", nargs="+", default=["dense", "int4", "fp8"], choices=["dense", "int4", "fp8"])
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("no GPU: timing the CPU torch path (float32); numbers are not kernel figures")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    name, (gbps, _, _) = device_peaks()
    vllm = _vllm_fused_moe() if device == "cuda" else None
    E, D, inter, top_k = args.experts, args.hidden, args.intermediate, args.top_k
    rows = []
    for kind in args.weights:
        gate_up = random_experts(kind, E, 2 * inter, D, dtype, device)
        down = random_experts(kind, E, D, inter, dtype, device)
        weight_bytes = sum(t.numel() * t.element_size() for w in (gate_up, down)
                           for t in vars(w).values() if isinstance(t, torch.Tensor))
        for T in args.tokens:
            x = torch.randn(T, D, device=device).to(dtype)
            weights, ids = grouped_topk(torch.randn(T, E, device=device), top_k)
            touched = ids.unique().numel() / E  # fraction of expert weights a call must read
            ours = time_ms(lambda: fused_moe(x, gate_up, down, weights, ids))
            loop = time_ms(lambda: fused_moe_reference(x, gate_up, down, weights, ids))
            row = {"weights": kind, "tokens": T, "ours_ms": ours, "loop_ms": loop, "vs_loop": loop / ours,
                   "GB/s": weight_bytes * touched / ours / 1e6, "hbm_frac": weight_bytes * touched / ours / 1e6 / gbps}
            if vllm is not None and kind == "dense":  # vLLM's bf16 path takes w13 [E, 2I, D], w2 [E, D, I]
                theirs = time_ms(lambda: vllm(x, gate_up.weight, down.weight, weights, ids))
                row.update(vllm_ms=theirs, vs_vllm=theirs / ours)
            rows.append(row)
    print(f"fused MoE on {name}: E={E} top_k={top_k} hidden={D} intermediate={inter} {dtype}")
    print_table(rows)
    if args.out:
        write_json(args.out, "moe", rows, experts=E, top_k=top_k, hidden=D, intermediate=inter)
