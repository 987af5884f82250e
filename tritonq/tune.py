"""Launch-config tuner: `python -m tritonq.tune --kernel KERNEL --shapes SHAPE,...`.

Kernels and their --shapes format (x-separated ints):
  int4_gemm, fp8_gemm  MxNxK                   (or --model PATH: every linear layer of the model)
  attention_prefill    BxSxHxHkvxDqkxDv        batch, tokens, query heads, kv heads, head dims
  attention_decode     BxSmaxxHxHkvxDqkxDv     batch, cache capacity, heads, head dims
  moe                  TxExTOPKxDxI            tokens, experts, experts per token, hidden, intermediate
                                               (int4 group-128 experts; its two GEMMs are tuned apart)
For each shape, every candidate config of the kernel's declared search space is first checked
against the torch reference, then timed (triton.testing.do_bench); the fastest correct one is
written to tritonq/kernels/configs/<kernel>/<gpu-name>.json under the kernel's shape bucket,
where the launcher's `lookup` finds it at run time. Without a GPU:
  --dry-run   runs every candidate in the Triton interpreter on small shapes and checks it
              (the first correct candidate per bucket is written, to show the file round-trips);
  --aot sm_90 compiles every candidate for that GPU and prints shared memory, registers,
              spills and whether wgmma was used, rejecting candidates that spill or overflow.
--where BLOCK_M=16,num_warps=4 narrows a sweep to the candidates with those values.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from tritonq.bench.common import model_gemm_shapes, parse_shapes, print_table
from tritonq.kernels import configs

MODEL_M = (1, 16, 64, 256)  # decode, small batch, the int4/fp16 crossover, prefill


@dataclass(frozen=True)
class TuneTarget:
    """What the tuner needs from a kernel family.

    space(shape) -> the candidate launch configs legal for that shape ({"BLOCK_M": .., ...}).
    make_inputs(shape, device) -> inputs; run(inputs, config) -> output; reference(inputs) -> output.
    bucket(inputs) -> the key the launcher looks its config up under.
    aot(config, shape, cc) -> tritonq.kernels.aot.CompileReport.
    atol, rtol: output tolerance against the reference (set by the kernel's compute dtype).
    dry_run_shapes: small shapes for --dry-run in the interpreter.
    launch_only: config keys that change how a kernel compiles, not what it computes
    (num_warps, num_stages): the interpreter ignores them, so a dry run checks one per tile.
    shape_format: what the ints of a --shapes entry mean, e.g. "MxNxK".
    problems(shape) -> the tuning problems a shape stands for, each with its own space, inputs and
    bucket (MoE: its gate/up and down GEMMs); by default the shape itself.
    """
    name: str
    space: Callable[[tuple[int, ...]], list[dict]]
    make_inputs: Callable
    run: Callable
    reference: Callable
    bucket: Callable
    aot: Callable
    atol: float
    rtol: float
    dry_run_shapes: tuple[tuple[int, ...], ...]
    launch_only: tuple[str, ...] = ("num_warps", "num_stages")
    shape_format: str = "MxNxK"
    problems: Callable[[tuple[int, ...]], list[tuple[int, ...]]] = lambda shape: [shape]


def _int4_group_size(K: int) -> int:
    return 128 if K % 128 == 0 else 32


def _int4_gemm_target() -> TuneTarget:
    import triton

    from tritonq.bench.int4_gemm import random_int4_weight
    from tritonq.kernels import int4_gemm as k

    def space(shape):
        """CONFIG_SPACE restricted to what is legal and useful for this shape: the decode path
        (M <= SPLIT_K_MAX_M) uses BLOCK_M 16 with split-K, larger M no split-K and BLOCK_M <= M;
        BLOCK_K divides the group size (else the launcher shrinks it) and fits K with its split."""
        M, N, K = shape
        s = k.CONFIG_SPACE
        small = M <= k.SPLIT_K_MAX_M
        out = []
        for bm, bn, bk, sk, warps, stages in itertools.product(
                s["BLOCK_M"], s["BLOCK_N"], s["BLOCK_K"], s["SPLIT_K"], s["num_warps"], s["num_stages"]):
            if (bm != 16 if small else (sk != 1 or bm > max(16, triton.next_power_of_2(M)))):
                continue
            if _int4_group_size(K) % bk or bk * sk > K or bn > max(32, triton.next_power_of_2(N)):
                continue
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=warps, num_stages=stages))
        return out

    def make_inputs(shape, device):
        M, N, K = shape
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        return torch.randn(M, K, dtype=dtype, device=device), random_int4_weight(N, K, dtype, device,
                                                                                  _int4_group_size(K))

    def aot(config, shape, cc):
        """The fp16, asymmetric, no-act-order, no-bias variant that AWQ/GPTQ checkpoints run."""
        pointers = {"x_ptr": "*fp16", "qweight_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*fp16",
                    "g_idx_ptr": "*i32", "bias_ptr": "*fp16", "out_ptr": "*fp32" if config["SPLIT_K"] > 1 else "*fp16"}
        flags = {"BITS": 4, "HAS_ZEROS": True, "HAS_G_IDX": False, "TILE_GROUPS": True, "HAS_BIAS": False,
                 "UPCAST_DOT": False, **{key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}}
        _, N, K = shape
        ints = {"N": N, "K": K, "group_size": _int4_group_size(K), "stride_xm": K}
        return _aot_with_flags(k._int4_gemm_kernel, pointers, flags, ints, config, cc)

    return TuneTarget(
        name="int4_gemm", space=space, make_inputs=make_inputs,
        run=lambda inputs, config: k.int4_gemm(*inputs, config=k.Int4GemmConfig(**config)),
        reference=lambda inputs: k.int4_gemm_reference(*inputs),
        bucket=lambda inputs: k.config_bucket(inputs[0].shape[0], *inputs[1].shape, inputs[1]),
        aot=aot,
        # fp16 products summed in fp32 vs the fp32 reference: K * eps_fp16 * |x||w| stays well under this
        # at the |y| ~ 1 these inputs give; fp32 inputs (CPU dry run) are far tighter.
        atol=2e-2, rtol=2e-2,
        dry_run_shapes=((1, 64, 128), (17, 96, 256)))


# fp8_gemm declares its config type (FP8GemmConfig) but no sweep list: these are the values swept.
# BLOCK_K 64/128 divide the 128-wide scale blocks, so every winner is valid for block weights too.
FP8_SPACE = {"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128],
             "GROUP_M": [1, 8], "SPLIT_K": [1, 2, 4, 8, 16], "num_warps": [4, 8], "num_stages": [2, 3, 4]}


def _fp8_gemm_target() -> TuneTarget:
    """Tunes the path the runtime takes on this device: fp8 x fp8 (sm_89+) or weight-only below,
    stored under the kernel name the launcher looks up for that path."""
    import triton

    from tritonq.formats.base import to_device
    from tritonq.kernels import fp8_gemm as k
    from tritonq.quantize import quantize_fp8

    weight_only = torch.cuda.is_available() and k._lacks_fp8_tensor_cores(torch.device("cuda"))

    def space(shape):
        """Decode sizes (M <= 16) use BLOCK_M 16 and no GROUP_M swizzle; split-K only up to M 64."""
        M, N, K = shape
        out = []
        for values in itertools.product(*FP8_SPACE.values()):
            c = dict(zip(FP8_SPACE, values))
            if M <= 16 and (c["BLOCK_M"] != 16 or c["GROUP_M"] != 1):
                continue
            if c["BLOCK_M"] > max(16, triton.next_power_of_2(M)) or (M > 64 and c["SPLIT_K"] > 1):
                continue
            if c["BLOCK_N"] > max(32, triton.next_power_of_2(N)) or c["BLOCK_K"] * c["SPLIT_K"] > K:
                continue
            out.append(c)
        return out

    def make_inputs(shape, device):
        M, N, K = shape
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        w = quantize_fp8(torch.randn(N, K) * 0.05, scheme="block" if K % 128 == 0 else "channel")
        w = to_device(w, device)
        return torch.randn(M, K, dtype=dtype, device=device), w

    def aot(config, shape, cc):
        """Block-scaled (128x128) weights, fp16 activations: fp8 x fp8 from sm_89, weight-only below."""
        kernel = k._fp8_gemm_kernel
        no_fp8 = cc < 89
        pointers = {"a_ptr": "*fp16" if no_fp8 else "*fp8e4nv", "a_scale_ptr": "*fp32",
                    "w_ptr": "*u8" if no_fp8 else "*fp8e4nv", "w_scale_ptr": "*fp32", "bias_ptr": "*fp16",
                    "y_ptr": "*fp32" if config["SPLIT_K"] > 1 else "*fp16"}
        flags = {"A_GROUP": 128, "W_SCALE_BN": 128, "W_SCALE_BK": 128, "SCALE_PER_TILE": True,
                 "WEIGHT_ONLY": no_fp8, "HAS_BIAS": False,
                 **{key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K")}}
        _, N, K = shape
        ints = {"N": N, "K": K, "stride_am": K, "stride_wn": K, "stride_ym": N}
        return _aot_with_flags(kernel, pointers, flags, ints, config, cc)

    return TuneTarget(
        name="fp8_gemm_weight_only" if weight_only else "fp8_gemm", space=space, make_inputs=make_inputs,
        run=lambda inputs, config: k.fp8_gemm(*inputs, weight_only=weight_only, config=k.FP8GemmConfig(**config)),
        reference=lambda inputs: k.fp8_gemm_reference(*inputs, weight_only=weight_only),
        bucket=lambda inputs: k.config_bucket(inputs[0].shape[0], *inputs[1].shape),
        aot=aot,
        # Kernel and reference quantize activations identically and accumulate in fp32; what is
        # left is summation order and the fp16 output rounding, far below this at |y| ~ 1.
        atol=2e-2, rtol=2e-2,
        dry_run_shapes=((1, 64, 256), (17, 96, 256)))


def shape_fields(shape_format: str) -> list[str]:
    """"BxSmaxxHxHkvxDqkxDv" -> ["B", "Smax", "H", "Hkv", "Dqk", "Dv"]: an x before a capital separates."""
    return re.split(r"x(?=[A-Z])", shape_format)


def _unpack(shape: tuple[int, ...], target: str, shape_format: str) -> tuple[int, ...]:
    """shape, checked to have one positive int per field of shape_format."""
    fields = shape_fields(shape_format)
    if len(shape) != len(fields) or min(shape) < 1:
        raise ValueError(f"{target} shape {'x'.join(map(str, shape))}: expected {len(fields)} positive ints "
                         f"{shape_format}")
    return shape


def _kernel_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs (what the models run); fp32 in the interpreter, whose bf16 tl.dot is wrong."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _sm_count(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


# Attention outputs are convex combinations of N(0, 1) value rows (|o| < ~4). In bf16 the kernel
# rounds p to bf16 before the PV dot and rounds the output (2^-9 relative each), so 2e-2 bounds
# it; fp32 (interpreter) differs only by summation order and exp2 vs exp. Chosen once per process:
# a --dry-run on a GPU machine checks its fp32 run at the looser bf16 bound.
ATTENTION_TOL = 2e-2 if torch.cuda.is_available() else 1e-4

PREFILL_SPACE = {"BLOCK_M": [64, 128], "BLOCK_N": [32, 64, 128], "num_warps": [4, 8], "num_stages": [2, 3]}
PREFILL_FORMAT = "BxSxHxHkvxDqkxDv"
DECODE_SPACE = {"BLOCK_N": [16, 32, 64, 128], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3]}
DECODE_FORMAT = "BxSmaxxHxHkvxDqkxDv"


def _head_blocks(d_qk: int, d_v: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_DR, BLOCK_DV) as the attention launchers pick them."""
    import triton

    from tritonq.kernels.attention import qk_blocks
    return (*qk_blocks(d_qk), max(16, triton.next_power_of_2(d_v)))


def _attention_heads(shape, target: str, shape_format: str) -> tuple[int, ...]:
    shape = _unpack(shape, target, shape_format)
    if shape[2] % shape[3]:
        raise ValueError(f"{target} shape {'x'.join(map(str, shape))}: query heads H={shape[2]} must be a "
                         f"multiple of kv heads Hkv={shape[3]}")
    return shape


def _lengths(batch: int, full: int, device: torch.device) -> torch.Tensor:
    """int32 [batch]: the first sequence at full length, the others random in [1, full]."""
    lens = torch.randint(1, full + 1, (batch,), dtype=torch.int32)
    lens[0] = full
    return lens.to(device)


def _attention_prefill_target() -> TuneTarget:
    """Causal prefill (what the models run), bucketed by head-dim blocks like `prefill_config`."""
    import triton

    from tritonq.kernels import attention as k

    def space(shape):
        """Tiles wider than the sequence (rounded up to a power of two) only compute padding."""
        _, S, *_ = _attention_heads(shape, "attention_prefill", PREFILL_FORMAT)
        out = []
        for values in itertools.product(*PREFILL_SPACE.values()):
            c = dict(zip(PREFILL_SPACE, values))
            if c["BLOCK_M"] > max(64, triton.next_power_of_2(S)) or c["BLOCK_N"] > max(32, triton.next_power_of_2(S)):
                continue
            out.append(c)
        return out

    def make_inputs(shape, device):
        B, S, H, H_kv, d_qk, d_v = _attention_heads(shape, "attention_prefill", PREFILL_FORMAT)
        dtype = _kernel_dtype(device)
        q, key = torch.randn(B, S, H, d_qk, dtype=dtype, device=device), torch.randn(B, S, H_kv, d_qk, dtype=dtype,
                                                                                     device=device)
        return q, key, torch.randn(B, S, H_kv, d_v, dtype=dtype, device=device), _lengths(B, S, device), d_qk ** -0.5

    def run(inputs, config):
        cfg = k.PrefillConfig(config["BLOCK_M"], config["BLOCK_N"], config["num_warps"], config["num_stages"])
        return k.prefill_attention(*inputs, causal=True, config=cfg)

    def aot(config, shape, cc):
        """bf16 q/k/v/o, contiguous [B, S, H, D] tensors as the models pass them."""
        _, S, H, H_kv, d_qk, d_v = _attention_heads(shape, "attention_prefill", PREFILL_FORMAT)
        block_d, block_dr, block_dv = _head_blocks(d_qk, d_v)
        pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16", "seq_lens_ptr": "*i32"}
        flags = {"GROUP": H // H_kv, "CAUSAL": True, "HAS_WINDOW": False, "BLOCK_M": config["BLOCK_M"],
                 "BLOCK_N": config["BLOCK_N"], "BLOCK_D": block_d, "BLOCK_DR": block_dr, "BLOCK_DV": block_dv}
        ints = {"stride_qb": S * H * d_qk, "stride_qs": H * d_qk, "stride_qh": d_qk,
                "stride_kb": S * H_kv * d_qk, "stride_ks": H_kv * d_qk, "stride_kh": d_qk,
                "stride_vb": S * H_kv * d_v, "stride_vs": H_kv * d_v, "stride_vh": d_v,
                "stride_ob": S * H * d_v, "stride_os": H * d_v, "stride_oh": d_v, "S": S, "H": H,
                "D_QK": d_qk, "D_V": d_v}
        return _aot_with_flags(k._prefill_kernel, pointers, flags, ints, config, cc, floats=("qk_scale",))

    return TuneTarget(
        name="attention_prefill", space=space, make_inputs=make_inputs, run=run,
        reference=lambda inputs: k.prefill_attention_reference(*inputs, causal=True),
        bucket=lambda inputs: k.config_bucket(*_head_blocks(inputs[0].shape[-1], inputs[2].shape[-1])),
        aot=aot, atol=ATTENTION_TOL, rtol=ATTENTION_TOL,
        dry_run_shapes=((2, 40, 4, 2, 72, 40), (1, 130, 2, 1, 64, 64)), shape_format=PREFILL_FORMAT)


def _attention_decode_target() -> TuneTarget:
    """Split-KV decode over a contiguous cache (paged caches run the same tiles, BLOCK_N capped at
    the page size); num_splits is not swept: the launcher derives it (`decode_num_splits`)."""
    import triton

    from tritonq.kernels import attention as k

    def space(shape):
        _, S_max, *_ = _attention_heads(shape, "attention_decode", DECODE_FORMAT)
        out = []
        for values in itertools.product(*DECODE_SPACE.values()):
            c = dict(zip(DECODE_SPACE, values))
            if c["BLOCK_N"] <= max(16, triton.next_power_of_2(S_max)):
                out.append(c)
        return out

    def make_inputs(shape, device):
        B, S_max, H, H_kv, d_qk, d_v = _attention_heads(shape, "attention_decode", DECODE_FORMAT)
        dtype = _kernel_dtype(device)
        q = torch.randn(B, H, d_qk, dtype=dtype, device=device)
        k_cache = torch.randn(B, S_max, H_kv, d_qk, dtype=dtype, device=device)
        v_cache = torch.randn(B, S_max, H_kv, d_v, dtype=dtype, device=device)
        return q, k_cache, v_cache, _lengths(B, S_max, device), d_qk ** -0.5

    def run(inputs, config):
        q, k_cache = inputs[:2]
        splits = k.decode_num_splits(q.shape[0], k_cache.shape[2], k_cache.shape[1], config["BLOCK_N"],
                                     _sm_count(q.device))
        cfg = k.DecodeConfig(config["BLOCK_N"], splits, config["num_warps"], config["num_stages"])
        return k.decode_attention(*inputs, config=cfg)

    def aot(config, shape, cc):
        """Stage 1 (the tuned kernel) with bf16 q/k/v, an unpaged cache, splits as on a 132-SM H100/H200."""
        B, S_max, H, H_kv, d_qk, d_v = _attention_heads(shape, "attention_decode", DECODE_FORMAT)
        block_d, block_dr, block_dv = _head_blocks(d_qk, d_v)
        group = H // H_kv
        sm_count = {80: 108, 86: 84, 89: 128, 90: 132}.get(cc, 108)
        pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "cache_lens_ptr": "*i32",
                    "block_table_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        flags = {"GROUP": group, "NUM_SPLITS": k.decode_num_splits(B, H_kv, S_max, config["BLOCK_N"], sm_count),
                 "BLOCK_H": min(64, max(16, triton.next_power_of_2(group))), "BLOCK_N": config["BLOCK_N"],
                 "BLOCK_D": block_d, "BLOCK_DR": block_dr, "BLOCK_DV": block_dv, "PAGE_SIZE": 0,
                 "HAS_WINDOW": False}
        ints = {"stride_qb": H * d_qk, "stride_qh": d_qk, "stride_kb": S_max * H_kv * d_qk, "stride_ks": H_kv * d_qk,
                "stride_kh": d_qk, "stride_vb": S_max * H_kv * d_v, "stride_vs": H_kv * d_v, "stride_vh": d_v,
                "stride_bt": 1, "H": H, "D_QK": d_qk, "D_V": d_v}
        return _aot_with_flags(k._decode_split_kernel, pointers, flags, ints, config, cc, floats=("qk_scale",))

    return TuneTarget(
        name="attention_decode", space=space, make_inputs=make_inputs, run=run,
        reference=lambda inputs: k.decode_attention_reference(*inputs),
        bucket=lambda inputs: k.config_bucket(*_head_blocks(inputs[0].shape[-1], inputs[2].shape[-1])),
        aot=aot, atol=ATTENTION_TOL, rtol=ATTENTION_TOL,
        dry_run_shapes=((3, 100, 8, 2, 72, 40), (2, 64, 16, 1, 576, 512)), shape_format=DECODE_FORMAT)


MOE_SPACE = {"BLOCK_M": [16, 32, 64], "BLOCK_N": [64, 128], "BLOCK_K": [64, 128], "num_warps": [4, 8],
             "num_stages": [2, 3]}
MOE_FORMAT = "TxExTOPKxDxI"
MOE_GEMMS = ("gate_up", "down")  # a moe problem is (T, E, TOPK, D, I, index into MOE_GEMMS)


def _moe_problem(shape) -> tuple[int, ...]:
    """(T, E, TOPK, D, I, gemm) checked: TOPK <= E; D and I multiples of 32 (int4 groups)."""
    *dims, gemm = shape if len(shape) == 6 else (*shape, 0)
    T, E, top_k, D, inter = _unpack(tuple(dims), "moe", MOE_FORMAT)
    if top_k > E or D % 32 or inter % 32 or gemm not in (0, 1):
        raise ValueError(f"moe shape {'x'.join(map(str, dims))} ({MOE_FORMAT}): needs TOPK <= E and D, I "
                         f"multiples of 32 (int4 group size)")
    return T, E, top_k, D, inter, gemm


def _moe_target() -> TuneTarget:
    """Fused MoE with int4 experts (group 128, asymmetric: AWQ/GPTQ checkpoints, as `bench moe`).

    The launcher looks up each GEMM under its own bucket (gate/up: N=I, K=D; down: N=D, K=I), so
    a shape is two problems. A candidate for one GEMM runs with the other GEMM's default config
    (`moe.default_config`) at the candidate's BLOCK_M, since both share one token alignment; the
    whole fused_moe is checked and timed.
    """
    import triton

    from tritonq.bench.moe import int4_expert_group_size, random_experts
    from tritonq.kernels import moe as k
    from tritonq.kernels.moe import MoEConfig

    def space(problem):
        """BLOCK_M up to the tokens per expert (rounded up); BLOCK_N, BLOCK_K up to the GEMM's N, K."""
        T, E, top_k, D, inter, gemm = _moe_problem(problem)
        N, K = (inter, D) if gemm == 0 else (D, inter)
        max_m = max(16, triton.next_power_of_2(triton.cdiv(T * top_k, E)))
        out = []
        for values in itertools.product(*MOE_SPACE.values()):
            c = dict(zip(MOE_SPACE, values))
            if (c["BLOCK_M"] <= max_m and c["BLOCK_N"] <= max(64, triton.next_power_of_2(N))
                    and c["BLOCK_K"] <= max(64, triton.next_power_of_2(K))):
                out.append(c)
        return out

    def make_inputs(problem, device):
        from tritonq.kernels.moe import grouped_topk

        T, E, top_k, D, inter, gemm = _moe_problem(problem)
        dtype = _kernel_dtype(device)
        x = torch.randn(T, D, dtype=dtype, device=device)
        gate_up = random_experts("int4", E, 2 * inter, D, dtype, device)
        down = random_experts("int4", E, D, inter, dtype, device)
        weights, ids = grouped_topk(torch.randn(T, E, device=device), top_k, renormalize=True)
        return x, gate_up, down, weights, ids, gemm

    def run(inputs, config):
        x, gate_up, down, weights, ids, gemm = inputs
        tuned = MoEConfig(**config)
        other = replace(k.default_config(*ids.shape, gate_up.qweight.shape[0]), BLOCK_M=tuned.BLOCK_M)
        return k.fused_moe(x, gate_up, down, weights, ids, config=(tuned, other) if gemm == 0 else (other, tuned))

    def bucket(inputs):
        x, _, down, _, _, gemm = inputs
        (T, D), (E, inter) = x.shape, (down.qweight.shape[0], down.qweight.shape[1] * 8)
        return k.config_bucket(T, E, inter, D) if gemm == 0 else k.config_bucket(T, E, D, inter)

    def aot(config, problem, cc):
        """The candidate's GEMM with bf16 activations and int4 group-128 experts, strides as the launcher's."""
        T, _, top_k, D, inter, gemm = _moe_problem(problem)
        gate = gemm == 0
        N, K, w_rows = (inter, D, 2 * inter) if gate else (D, inter, D)  # w_rows: the stacked weight's N
        group_size = int4_expert_group_size(K)
        pointers = {"a_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*i32", "scale_ptr": "*bf16", "zero_ptr": "*bf16",
                    "g_idx_ptr": "*i32", "routing_weight_ptr": "*fp32", "sorted_ids_ptr": "*i32",
                    "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32"}
        flags = {"GATE_UP": gate, "KIND": k.INT4, "BITS": 4, "HAS_ZEROS": True, "HAS_G_IDX": False,
                 "TILE_SCALE_ROW": group_size % config["BLOCK_K"] == 0, "SCALE_BN": 1, "SCALE_BK": 1,
                 "FP8_AS_BITS": False, "UPCAST_DOT": False,
                 **{key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}}
        ints = {"num_valid": T * top_k, "N": N, "K": K, "up_offset": inter, "a_row_divisor": top_k if gate else 1,
                "stride_am": K, "stride_om": N, "stride_we": K // 8 * w_rows, "stride_wn": 1, "stride_wk": w_rows,
                "stride_se": K // group_size * w_rows, "stride_sn": 1, "stride_sk": w_rows, "group_size": group_size}
        return _aot_with_flags(k._moe_gemm_kernel, pointers, flags, ints, config, cc)

    return TuneTarget(
        name="moe", space=space, make_inputs=make_inputs, run=run,
        reference=lambda inputs: k.fused_moe_reference(*inputs[:5]), bucket=bucket, aot=aot,
        # bf16: x, the dequantized weights and the SiLU-and-mul hidden are each rounded to bf16 (8-bit
        # mantissa) before a GEMM, at unit-scale outputs (tests/kernels/test_moe.py's bound); fp32
        # (interpreter, exact fp32 dots) differs only by summation order.
        atol=5e-2 if torch.cuda.is_available() else 1e-4, rtol=5e-2 if torch.cuda.is_available() else 1e-4,
        dry_run_shapes=((3, 8, 2, 64, 96), (40, 4, 2, 128, 64)), shape_format=MOE_FORMAT,
        problems=lambda shape: [(*_moe_problem(shape)[:5], gemm) for gemm in range(len(MOE_GEMMS))])


def _aot_with_flags(kernel, pointers: dict, flags: dict, ints: dict, config: dict, cc: int, floats: tuple = ()):
    """AOT-compile kernel: `pointers` typed as given, `floats` fp32, other runtime args i32, constexprs from flags.

    As the launcher specializes at run time, pointers and the 16-divisible `ints` get the hint.
    """
    from tritonq.kernels.aot import aot_compile

    params = [(p.name, p.is_constexpr) for p in kernel.params]
    unknown = [name for name, is_constexpr in params if is_constexpr and name not in flags]
    if unknown:
        raise ValueError(f"{kernel.__name__} has constexpr args {unknown} that tune's AOT variant does not set")
    signature = {name: pointers.get(name, "fp32" if name in floats else "i32")
                 for name, is_constexpr in params if not is_constexpr}
    constexprs = {name: flags[name] for name, is_constexpr in params if is_constexpr}
    aligned = [*pointers, *(name for name, value in ints.items() if value % 16 == 0)]
    return aot_compile(kernel, signature, constexprs, cc, num_warps=config["num_warps"],
                       num_stages=config["num_stages"], divisible_by_16=tuple(n for n in aligned if n in signature))


TARGETS: dict[str, Callable[[], TuneTarget]] = {
    "int4_gemm": _int4_gemm_target, "fp8_gemm": _fp8_gemm_target, "attention_prefill": _attention_prefill_target,
    "attention_decode": _attention_decode_target, "moe": _moe_target}


def check_candidate(target: TuneTarget, inputs, config: dict, ref: torch.Tensor | None = None) -> str | None:
    """None if the candidate's output matches the reference (`ref`, computed if None), else why not."""
    try:
        out = target.run(inputs, config)
    except Exception as e:  # a candidate the kernel rejects (e.g. BLOCK_K > group size) is skipped
        return f"{type(e).__name__}: {e}"
    ref = target.reference(inputs) if ref is None else ref
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = (out.float() - ref.float()).abs().max().item()
    if not torch.allclose(out.float(), ref.float(), atol=target.atol, rtol=target.rtol):
        return f"max abs error {err:.3g} over atol={target.atol}, rtol={target.rtol}"
    return None


def candidates(target: TuneTarget, shape: tuple[int, ...], timed: bool, where: dict | None = None) -> list[dict]:
    """The configs to try for `shape`: those matching `where`; untimed, one per distinct tile."""
    space = target.space(shape)
    unknown = set(where or {}) - {key for c in space for key in c}
    if unknown:
        raise ValueError(f"--where keys {sorted(unknown)} are not {target.name} config fields; "
                         f"fields: {sorted({key for c in space for key in c})}")
    space = [c for c in space if all(c.get(k) == v for k, v in (where or {}).items())]
    if timed:
        return space
    tiles = {}
    for c in space:
        tiles.setdefault(tuple((k, v) for k, v in c.items() if k not in target.launch_only), c)
    return list(tiles.values())


def tune(target: TuneTarget, shapes: list[tuple[int, ...]], device: torch.device, timed: bool,
         where: dict | None = None, progress: bool = True) -> dict[str, dict]:
    """{bucket: winning config} over the problems of `shapes`; failing candidates are dropped.

    A winner must pass on every problem of its bucket. Timed, it has the least geometric-mean time
    over them: one attention bucket (its head dims) may cover shapes of very different cost, and
    the geometric mean weighs each shape's relative speedup alike. timed=False (dry run) keeps the
    first such candidate in declared order.
    """
    from tqdm import tqdm

    problems = [problem for shape in shapes for problem in target.problems(shape)]
    spaces = [candidates(target, problem, timed, where) for problem in problems]
    bar = tqdm(total=sum(map(len, spaces)), desc=target.name, disable=not progress)
    per_bucket = Counter()
    passed: dict[str, dict[str, list]] = {}  # bucket -> config text -> [config, problems passed, sum of log ms]
    for problem, space in zip(problems, spaces):
        inputs = target.make_inputs(problem, device)
        bucket = target.bucket(inputs)
        per_bucket[bucket] += 1
        entries = passed.setdefault(bucket, {})
        ref = target.reference(inputs)
        for config in space:
            bar.update()
            failure = check_candidate(target, inputs, config, ref)
            if failure:
                bar.write(f"{problem} {config}: rejected ({failure})")
                continue
            ms = 1.0
            if timed:
                import triton.testing
                ms = triton.testing.do_bench(lambda inputs=inputs, config=config: target.run(inputs, config),
                                             warmup=25, rep=100)
            entry = entries.setdefault(json.dumps(config, sort_keys=True), [config, 0, 0.0])
            entry[1] += 1
            entry[2] += math.log(max(ms, 1e-9))
    bar.close()
    winners = {}
    for bucket, entries in passed.items():
        everywhere = [entry for entry in entries.values() if entry[1] == per_bucket[bucket]]
        if everywhere:  # min keeps the first of equal times: the declared order in a dry run
            winners[bucket] = min(everywhere, key=lambda entry: entry[2])[0]
    missing = set(per_bucket) - set(winners)
    if missing:
        raise RuntimeError(f"no candidate of {target.name} passed the reference check (on every shape of the "
                           f"bucket) for buckets {sorted(missing)}")
    return winners


def write_configs(kernel: str, gpu: str, winners: dict[str, dict], config_dir: Path) -> Path:
    """Merge winners into config_dir/<kernel>/<gpu>.json (other buckets are kept)."""
    path = config_dir / kernel / f"{gpu}.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    table.update(winners)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    configs.load_configs.cache_clear()  # the runtime sees the new file in this process too
    return path


def aot_table(target: TuneTarget, shape: tuple[int, ...], cc: int, where: dict | None = None) -> list[dict]:
    """One row per candidate: config, shared memory, registers, spills, wgmma, verdict."""
    rows = []
    for config in candidates(target, shape, timed=True, where=where):
        try:
            r = target.aot(config, shape, cc)
        except Exception as e:
            rows.append({"config": _config_text(config), "verdict": f"rejected: {type(e).__name__}: {e}"[:100]})
            continue
        verdict = ("rejected: shared memory overflow" if not r.fits else
                   "rejected: register spills" if r.spills else "ok")
        rows.append({"config": _config_text(config), "shared_bytes": r.shared_bytes,
                     "registers": r.registers, "spills": r.spills, "wgmma": r.uses_wgmma, "verdict": verdict})
    return rows


def _config_text(config: dict) -> str:
    short = {"BLOCK_M": "BM", "BLOCK_N": "BN", "BLOCK_K": "BK", "SPLIT_K": "SK", "GROUP_M": "GM", "num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short.get(k, k)}{v}" for k, v in config.items())


def model_shapes(path: str | Path, ms: tuple[int, ...] = MODEL_M) -> list[tuple[int, int, int]]:
    """(M, N, K) for every linear layer of the model at `path` (folder or config.json) and M in ms."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.exists():
        raise ValueError(f"--model {path}: no config.json found; pass a model folder or its config.json")
    layers = model_gemm_shapes(json.loads(config_path.read_text()))
    return sorted({(M, N, K) for M in ms for _, N, K in layers})


def _parse_where(text: str) -> dict:
    where = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            raise ValueError(f"bad --where item {item!r}: expected KEY=INT, e.g. BLOCK_M=16")
        where[key] = int(value)
    return where


def _reexec_with_interpreter(interpret: bool, argv: list[str]) -> None:
    """The interpreter is chosen when @triton.jit runs (at import), so switch it by restarting."""
    if (os.environ.get("TRITON_INTERPRET") == "1") == interpret:
        return
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    os.execve(sys.executable, [sys.executable, "-m", "tritonq.tune", *argv], env)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m tritonq.tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", required=True, choices=sorted(TARGETS))
    p.add_argument("--shapes", default=None,
                   help="comma-separated shapes in the kernel's format: MxNxK (int4_gemm, fp8_gemm), "
                        f"{PREFILL_FORMAT} (attention_prefill), {DECODE_FORMAT} (attention_decode), "
                        f"{MOE_FORMAT} (moe)")
    p.add_argument("--model", default=None, help="model folder or config.json: tune its GEMM shapes (GEMMs only)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check every candidate in the Triton interpreter")
    mode.add_argument("--aot", default=None, metavar="sm_XX", help="compile every candidate for this GPU")
    p.add_argument("--where", default="", metavar="KEY=V,...",
                   help="sweep only candidates with these values, e.g. BLOCK_M=16,num_warps=4")
    p.add_argument("--config-dir", default=str(configs.CONFIG_DIR), help="where <kernel>/<gpu>.json goes")
    args = p.parse_args(argv)

    if args.aot:
        cc_text = args.aot.removeprefix("sm_").rstrip("a")
        if not cc_text.isdigit():
            p.error(f"--aot {args.aot!r}: expected a compute capability like sm_90 or sm_80")
        _reexec_with_interpreter(False, argv)
    if args.dry_run:
        _reexec_with_interpreter(True, argv)
    if not (args.dry_run or args.aot) and not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU; without one use --dry-run (interpreter check) or --aot sm_90")

    where = _parse_where(args.where)
    target = TARGETS[args.kernel]()
    shapes = parse_shapes(args.shapes) if args.shapes else []
    for shape in shapes:
        if len(shape) != len(shape_fields(target.shape_format)):
            p.error(f"--shapes {'x'.join(map(str, shape))}: {args.kernel} shapes are {target.shape_format}")
    if args.model:
        if target.shape_format != "MxNxK":
            p.error(f"--model gives GEMM shapes; for --kernel {args.kernel} pass --shapes {target.shape_format},...")
        shapes += model_shapes(args.model)
    if not shapes:
        if not (args.dry_run or args.aot):
            p.error(f"give --shapes {target.shape_format},..." + (" or --model PATH" if args.model is None
                                                                    and target.shape_format == "MxNxK" else ""))
        shapes = list(target.dry_run_shapes)
    for shape in shapes:  # a bad shape (e.g. H not a multiple of Hkv) fails here, before any sweep
        try:
            target.problems(shape)
            for problem in target.problems(shape):
                target.space(problem)
        except ValueError as e:
            p.error(f"--shapes: {e}")

    if args.aot:
        for shape in shapes:
            for problem in target.problems(shape):
                print(f"{target.name} {'x'.join(map(str, problem))} on {args.aot}:")
                print_table(aot_table(target, problem, int(cc_text), where))
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    winners = tune(target, shapes, device, timed=not args.dry_run, where=where)
    gpu = "cpu" if device.type == "cpu" else configs.gpu_name()
    path = write_configs(target.name, gpu, winners, Path(args.config_dir))
    print_table([{"bucket": b, "config": _config_text(c)} for b, c in sorted(winners.items())])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
