"""Fused MoE vs a per-expert loop (fused_moe_reference: each routed expert dequantized and run on its tokens),
and vLLM's fused_moe if importable, on one MoE layer of a real model's shape.

Layers (--models): qwen3-30b-a3b (128 experts, top-8, hidden 2048, moe_intermediate 768, softmax routing),
deepseek-v3 (256 experts, top-8, hidden 7168, moe_intermediate 2048, sigmoid routing over 8 groups keeping 4),
deepseek-v2-lite (64 experts, top-6, hidden 2048, moe_intermediate 1408). Experts dense, int4 (group 128,
asymmetric: AWQ / GPTQ) or fp8 (128x128 blocks: DeepSeek-V3's checkpoints). All candidates run side by side
in one process on the same inputs and routing.

On CPU (no GPU) the defaults are small for a shared box: int4 experts only, tokens 1..256, 3 timed calls,
and at most --experts 32 experts stored per layer (DeepSeek-V3's 256 would take 5.6 GB in int4): routing
then spreads a token's top-k over those, so each expert sees up to E / 32 times the tokens it would.
    python -m tritonq.bench moe [--models qwen3-30b-a3b deepseek-v3] [--tokens 1 16 256] [--weights int4]
                                [--experts N] [--rep N] [--out FILE]
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from tritonq.bench.common import device_peaks, print_table, time_ms, write_json
from tritonq.kernels.moe import fused_moe, fused_moe_reference, grouped_topk
from tritonq.random_weights import random_experts


@dataclass(frozen=True)
class MoELayer:
    """One model's MoE layer: E experts, top_k per token, hidden D, expert intermediate I, and its routing."""
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1


LAYERS = {
    "qwen3-30b-a3b": MoELayer(128, 8, 2048, 768),
    "deepseek-v3": MoELayer(256, 8, 7168, 2048, "sigmoid", 8, 4),
    "deepseek-v2-lite": MoELayer(64, 6, 2048, 1408),
}
CPU_MAX_EXPERTS = 32


def _vllm_fused_moe():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
        return fused_experts
    except Exception:  # not installed, or no GPU build
        return None


def _route(layer: MoELayer, E: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's routing over E stored experts (groups shrink with E; a sigmoid router gets its bias)."""
    n_group = min(layer.n_group, E // 2) if layer.scoring == "sigmoid" else 1
    while E % n_group:
        n_group -= 1
    topk_group = min(layer.topk_group, n_group)
    top_k = min(layer.top_k, topk_group * (E // n_group))  # a few stored experts: at most all of them
    bias = torch.randn(E, device=device) * 0.01 if layer.scoring == "sigmoid" else None
    return grouped_topk(torch.randn(T, E, device=device), top_k, n_group=n_group, topk_group=topk_group,
                        scoring=layer.scoring, correction_bias=bias, renormalize=True)


def main(argv: list[str]) -> None:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench moe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(LAYERS), default=list(LAYERS) if on_gpu
                        else ["qwen3-30b-a3b", "deepseek-v3"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096] if on_gpu else [1, 4, 16, 64, 256])
    parser.add_argument("--weights", nargs="+", default=["dense", "int4", "fp8"] if on_gpu else ["int4"],
                        choices=["dense", "int4", "fp8"])
    parser.add_argument("--experts", type=int, default=None if on_gpu else CPU_MAX_EXPERTS,
                        help="store at most this many experts per layer (default: all on GPU, "
                             f"{CPU_MAX_EXPERTS} on CPU)")
    parser.add_argument("--rep", type=int, default=None, help="timed calls per row on CPU (default 3)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.experts is not None and args.experts < 2:
        parser.error(f"--experts {args.experts}: expected at least 2")
    device = "cuda" if on_gpu else "cpu"
    if not on_gpu:
        print("no GPU: timing the CPU path (float32; fused_moe runs kernels/cpu/lowbit.py's per-expert GEMMs over "
              "weights prepared once) against the per-expert loop that dequantizes each expert per call")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    rep = {} if on_gpu else {"warmup": 1, "rep": args.rep or 3}
    name, (gbps, _, _) = device_peaks()
    vllm = _vllm_fused_moe() if on_gpu else None
    rows = []
    for model in args.models:
        layer = LAYERS[model]
        E = min(layer.experts, args.experts or layer.experts)
        E -= E % 2  # sigmoid group routing: groups of at least 2 experts
        D, inter = layer.hidden, layer.intermediate
        for kind in args.weights:
            gate_up = random_experts(kind, E, 2 * inter, D, dtype, device)
            down = random_experts(kind, E, D, inter, dtype, device)
            weight_bytes = sum(t.numel() * t.element_size() for w in (gate_up, down) for t in w.tensors().values())
            for T in args.tokens:
                x = torch.randn(T, D, device=device).to(dtype)
                weights, ids = _route(layer, E, T, device)
                touched = ids.unique().numel() / E  # fraction of expert weights a call must read
                ours = time_ms(lambda: fused_moe(x, gate_up, down, weights, ids), **rep)
                loop = time_ms(lambda: fused_moe_reference(x, gate_up, down, weights, ids), **rep)
                row = {"model": model, "experts": E, "weights": kind, "tokens": T, "ours_ms": ours, "loop_ms": loop,
                       "vs_loop": loop / ours, "GB/s": weight_bytes * touched / ours / 1e6}
                if on_gpu:
                    row["hbm_frac"] = row["GB/s"] / gbps
                if vllm is not None and kind == "dense":  # vLLM's bf16 path takes w13 [E, 2I, D], w2 [E, D, I]
                    theirs = time_ms(lambda: vllm(x, gate_up.weight, down.weight, weights, ids))
                    row.update(vllm_ms=theirs, vs_vllm=theirs / ours)
                rows.append(row)
            gate_up = down = None  # freed before the next kind's experts
    print(f"fused MoE on {name}, {dtype}")
    print_table(rows)
    if args.out:
        write_json(args.out, "moe", rows, layers={m: vars(LAYERS[m]) for m in args.models})
