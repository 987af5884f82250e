"""Mixture of experts: grouped top-k routing, token alignment, fused expert GEMM.

Routing `grouped_topk(router_logits [T, E])` -> (topk_weights [T, k] fp32, topk_ids [T, k] int32)
covers DeepSeek-V2 `greedy` / `group_limited_greedy` (softmax, group score = max in group) and
DeepSeek-V3 `noaux_tc` (sigmoid, correction bias for selection only, group score = sum of the
top-2 in group). Ties: the lower expert (or group) index wins, via a stable descending sort
(torch.topk does not promise this: on CPU, zeros(1, 8).topk(2) returns indices [6, 5]).
Routing is a handful of vectorised torch ops on a [T, E] fp32 tensor (E <= 256): a Triton
kernel would save a few microseconds of launches per layer and is not worth a second
implementation; `grouped_topk_reference` is an independent per-token loop.

Expert MLP `fused_moe(x [T, D], gate_up [E, 2I, D], down [E, D, I], topk_weights, topk_ids)`
-> [T, D] in x.dtype = sum_k w_k * down_e(silu(gate_e x) * up_e x), gate rows first in gate_up.
Weights are stacked typed weights (tritonq/weights.py, with a leading expert dim E):
  DenseWeight weight [E, N, K]; Int4Weight qweight [E, K*bits/32, N], scales/zeros [E, G, N],
  g_idx [E, K] or None; FP8Weight weight [E, N, K] fp8 with weight_scale [E] (per tensor),
  [E, N, 1] (per channel) or [E, ceil(N/bn), ceil(K/bk)] (block_size (bn, bk));
  MXFP4Weight blocks [E, N, K/32, 16] uint8 (two e2m1 codes a byte), scales [E, N, K/32] E8M0: the
  codes are decoded with integer ops (`e2m1_bits_to_fp16`) and scaled per 32 along K in the tile load,
  then the dot runs in the activations' dtype (fp16 on sm_75, bf16 above), as for int4.
Shared experts are not part of this: the model runs them as an ordinary MLP and adds them.
gpt-oss experts: stacked biases (gate_up.bias [E, 2I], down.bias [E, D]; each added to its GEMM's
output before the activation / the routing weight, as transformers' GptOssExperts) and
`activation=ClampedSwiGLU(alpha, limit)` in place of SiLU-and-mul, fused in the same epilogue.
A topk_ids entry of -1 is a slot whose expert this process does not hold (expert parallelism, see
layers.RoutedExperts): it contributes zero, and no kernel computes it.
On CPU (no interpreter) each routed expert runs through kernels/cpu_lowbit.py (its weights
prepared once, on the first call); `fused_moe_reference` (TRITONQ_BACKEND=torch) is the oracle.
FP8 experts run W8A8 where the checkpoint quantizes activations and the GPU has e4m3 tensor cores (sm_89+;
`fp8_w8a8`): each GEMM's input is quantized by fp8_gemm's `quantize_activation_fp8` per token (per-tensor /
per-channel weights), per 1 x 128 group (128 x 128 block weights) or with the static input_scale (the largest
over the experts), and the dot runs on e4m3 operands in fp32, scales applied after each K tile (block) or once
(per token x per channel). Weight-only otherwise (codes dequantized to x.dtype in-kernel): weight-only
checkpoints, below sm_89, and on the CPU backend / CPU torch reference.
Pipeline: `moe_align_block_size` sorts the T*k (token, slot) pairs by expert and pads each
expert's run to BLOCK_M, so each M block of rows belongs to one expert; `_moe_gemm_kernel`
then runs once for gate/up (two accumulators, SiLU-and-mul fused in the epilogue) and once
for down (routing weight multiplied in), each launch covering all experts; a sum over the
k slots puts the result back in token order.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritonq.kernels import cpu_lowbit, use_cpu_kernels, use_triton
from tritonq.kernels.common import (
    E4M3_TO_FP16_BIAS,
    ClampedSwiGLU,
    Launch,
    check_launch_config,
    dequantize_int_tile,
    e2m1_bits_to_fp16,
    e4m3_bits_to_fp16,
    has_fp8_tensor_cores,
    on_gpu,
    tune_group_size,
    tuned_or_default,
    unpack_int_tile,
    unpack_shape,
    upcast_dot,
)
from tritonq.kernels.fp8_gemm import fp8_round_trip, quantize_activation_fp8
from tritonq.weights import WEIGHT_TYPES, DenseWeight, FP8Weight, Int4Weight, MXFP4Weight, Weight

DENSE, INT4, FP8, MXFP4 = 0, 1, 2, 3  # the kernel's KIND: how the weight tile is loaded
FP8_DOT_MIN_K = 32  # tl.dot's smallest K for e4m3 operands (Triton's min_dot_size for 8-bit types)


# ----------------------------------------------------------------------------------------------
# Routing
# ----------------------------------------------------------------------------------------------

def _check_routing(router_logits, top_k, n_group, topk_group, scoring, correction_bias):
    if router_logits.dim() != 2:
        raise ValueError(f"grouped_topk: router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    E = router_logits.shape[1]
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"grouped_topk: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    if n_group < 1 or E % n_group:
        raise ValueError(f"grouped_topk: {E} experts cannot be split into n_group={n_group} equal groups")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"grouped_topk: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 1 <= top_k <= topk_group * (E // n_group):
        raise ValueError(f"grouped_topk: top_k={top_k} must be in [1, {topk_group * (E // n_group)}] "
                         f"(experts in the {topk_group} kept groups of {E // n_group})")
    if correction_bias is not None and correction_bias.shape != (E,):
        raise ValueError(f"grouped_topk: correction_bias must be [{E}], got {tuple(correction_bias.shape)}")
    if correction_bias is not None and E // n_group < 2:
        raise ValueError("grouped_topk: a correction bias scores groups by their top-2, groups need >= 2 experts")


def _stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim; equal values: lower index first."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def grouped_topk(router_logits: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                 scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                 renormalize: bool = False, routed_scaling_factor: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32).

    Experts outside the kept groups are masked to -inf (as vLLM and transformers' DeepSeek-V3;
    transformers' V2 fills 0.0, the same choice since softmax scores are positive and top_k
    never exceeds the kept experts). Weights are the un-biased scores of the chosen experts, divided by their
    sum (+1e-20, so underflowed sigmoid scores give 0, not NaN) if renormalize, times
    routed_scaling_factor.
    """
    _check_routing(router_logits, top_k, n_group, topk_group, scoring, correction_bias)
    T, E = router_logits.shape
    logits = router_logits.float()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        if correction_bias is None:
            group_scores = grouped.max(-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # a sum of values: ties do not matter
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, _stable_topk(group_scores, topk_group), True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = _stable_topk(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def grouped_topk_reference(router_logits: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                           scoring: str = "softmax", correction_bias: torch.Tensor | None = None,
                           renormalize: bool = False, routed_scaling_factor: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same routing written per token with Python sorting (key: score desc, then index asc).

    Its fp32 arithmetic (scores, bias, renormalization) runs on router_logits' device, as
    grouped_topk's does, so the two agree bit for bit there; every tensor names that device, never
    the default one."""
    _check_routing(router_logits, top_k, n_group, topk_group, scoring, correction_bias)
    T, E = router_logits.shape
    device = router_logits.device
    per_group = E // n_group
    all_weights, all_ids = [], []
    for t in range(T):
        logits = router_logits[t].float()
        scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float().to(device)
        scores, choice = scores.tolist(), choice.tolist()
        group_score = []
        for g in range(n_group):
            members = sorted(choice[g * per_group:(g + 1) * per_group], reverse=True)
            group_score.append(members[0] if correction_bias is None else
                               float(torch.tensor(members[0], dtype=torch.float32, device=device) + members[1]))
        groups = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        candidates = [e for e in range(E) if e // per_group in groups]
        ids = sorted(candidates, key=lambda e: (-choice[e], e))[:top_k]
        w = torch.tensor([scores[e] for e in ids], dtype=torch.float32, device=device)
        if renormalize:
            w = w / (w.sum() + 1e-20)
        all_weights.append(w * routed_scaling_factor)
        all_ids.append(torch.tensor(ids, dtype=torch.int32, device=device))
    return torch.stack(all_weights), torch.stack(all_ids)


# ----------------------------------------------------------------------------------------------
# Token alignment
# ----------------------------------------------------------------------------------------------

def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids, expert_ids, num_tokens_post_padded [1] int32).

    sorted_ids [max_blocks * block_m] int32: flat (token * k + slot) indices grouped by expert,
      each expert's run padded to a multiple of block_m with the sentinel T * k.
    expert_ids [max_blocks] int32: the expert of each block of block_m rows.
    max_blocks = min(T*k, ceil(T*k / block_m) + E) bounds the blocks without a host sync; blocks
    at or past num_tokens_post_padded are unused (the kernel exits on them).
    Vectorised torch (a stable sort and a few scans) rather than a kernel: it is O(T*k), and
    has no host sync (scatter_add, not bincount), so a decode step can be CUDA-graph captured.
    """
    flat = topk_ids.flatten().long()
    numel = flat.numel()
    device = flat.device
    order = torch.sort(flat, stable=True).indices             # pairs grouped by expert, token order kept
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    unpadded_start = counts.cumsum(0) - counts
    expert_of_sorted = flat[order]
    rank_in_expert = torch.arange(numel, device=device) - unpadded_start[expert_of_sorted]
    max_blocks = min(numel, triton.cdiv(numel, block_m) + num_experts)
    sorted_ids = torch.full((max_blocks * block_m,), numel, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert_of_sorted] + rank_in_expert] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


# ----------------------------------------------------------------------------------------------
# Fused expert GEMM
# ----------------------------------------------------------------------------------------------

@triton.jit
def _load_weight_tile(w_ptr, scale_ptr, zero_ptr, g_idx_ptr, expert, offs_k, offs_n, K, N,
                      stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                      group_size, KIND: tl.constexpr, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      HAS_G_IDX: tl.constexpr, TILE_SCALE_ROW: tl.constexpr, SCALE_BN: tl.constexpr,
                      SCALE_BK: tl.constexpr, FP8_AS_BITS: tl.constexpr, COMPUTE: tl.constexpr,
                      FP8_CODES: tl.constexpr = False):
    """The [BLOCK_K, BLOCK_N] tile W[n, k]^T of `expert`, dequantized to COMPUTE (zero outside K, N).
    FP8_CODES (W8A8 fp8 experts): the e4m3 codes themselves, unscaled (the kernel applies `_fp8_scale_row`)."""
    mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    if KIND == 0:  # dense [E, N, K]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=mask, other=0.0)
        w = w.to(COMPUTE)
    elif KIND == 1:  # int: qweight [E, K*BITS/32, N], packed along K (stride_wk is the packed-row stride)
        PACK: tl.constexpr = 32 // BITS
        BLOCK_K: tl.constexpr = offs_k.shape[0]
        offs_word = tl.min(offs_k, axis=0) // PACK + tl.arange(0, BLOCK_K // PACK)
        words = tl.load(w_base + offs_word[:, None] * stride_wk + offs_n[None, :] * stride_wn,
                        mask=(offs_word < K // PACK)[:, None] & (offs_n[None, :] < N), other=0)
        q = unpack_int_tile(words, BITS)
        if TILE_SCALE_ROW:  # the whole K tile is in one group: one [1, BLOCK_N] row of scales/zeros
            s_off = (expert.to(tl.int64) * stride_se + (tl.min(offs_k, axis=0) // group_size) * stride_sk
                     + offs_n[None, :] * stride_sn)
            s_mask = offs_n[None, :] < N
        else:
            if HAS_G_IDX:
                group = tl.load(g_idx_ptr + expert.to(tl.int64) * K + offs_k, mask=offs_k < K, other=0)
            else:
                group = offs_k // group_size
            s_off = expert.to(tl.int64) * stride_se + group[:, None] * stride_sk + offs_n[None, :] * stride_sn
            s_mask = mask
        scale = tl.load(scale_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
        zero = scale  # read only with HAS_ZEROS (else symmetric: zero = 2^(bits-1))
        if HAS_ZEROS:
            zero = tl.load(zero_ptr + s_off, mask=s_mask, other=0.0).to(tl.float32)
        w = dequantize_int_tile(q, scale, zero, BITS, HAS_ZEROS).to(COMPUTE)
    elif KIND == 3:  # mxfp4: blocks [E, N, K/2] bytes (stride_wk = 1), scales [E, N, K/32] uint8 E8M0
        BLOCK_K: tl.constexpr = offs_k.shape[0]
        offs_byte = tl.min(offs_k, axis=0) // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_base + offs_n[None, :] * stride_wn + offs_byte[:, None],
                         mask=(offs_byte[:, None] < K // 2) & (offs_n[None, :] < N), other=0).to(tl.int32)
        # byte j holds elements 2j (low nibble) and 2j + 1 (high): [BLOCK_K/2, 2, BLOCK_N] -> K order
        codes = (packed[:, None, :] >> (tl.arange(0, 2) * 4)[None, :, None]) & 15
        codes = tl.reshape(codes, (BLOCK_K, offs_n.shape[0]))
        # One scale per 32 rows of the tile (BLOCK_K % 32 == 0, checked by the launcher), broadcast in registers:
        # a per-element gather would hold a [BLOCK_K, BLOCK_N] tile of 64-bit addresses (spills at 16 rows).
        GROUPS: tl.constexpr = BLOCK_K // 32
        offs_group = tl.min(offs_k, axis=0) // 32 + tl.arange(0, GROUPS)
        scale_bits = tl.load(scale_ptr + expert.to(tl.int64) * stride_se + offs_n[None, :] * stride_sn
                             + offs_group[:, None] * stride_sk,
                             mask=(offs_group[:, None] < K // 32) & (offs_n[None, :] < N), other=0).to(tl.int32)
        # e2m1_bits_to_fp16 gives value / 2^14; fp32 bits (s + 14) << 23 are 2^(s - 127) x 2^14 for s <= 240
        # (the loader refuses larger scales)
        scale = ((scale_bits + 14) << 23).to(tl.float32, bitcast=True)
        w = tl.reshape(e2m1_bits_to_fp16(codes).to(tl.float32), (GROUPS, 32, offs_n.shape[0])) * scale[:, None, :]
        w = tl.reshape(w, (BLOCK_K, offs_n.shape[0])).to(COMPUTE)
    elif FP8_CODES:  # fp8 [E, N, K] as float8e4nv, for an e4m3 x e4m3 dot
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=mask, other=0.0)
    else:  # fp8 [E, N, K]; scale index (n // SCALE_BN, k // SCALE_BK), strides 0 where constant
        w_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        if FP8_AS_BITS:  # no fp8 types below sm_89: decode the bytes (exact; x 2^8 in fp32 undoes the bias)
            w = e4m3_bits_to_fp16(tl.load(w_ptrs, mask=mask, other=0)).to(tl.float32) * E4M3_TO_FP16_BIAS
        else:
            w = tl.load(w_ptrs, mask=mask, other=0.0)
        if TILE_SCALE_ROW:  # scales do not vary along K inside the tile: one [1, BLOCK_N] row
            s_off = (expert.to(tl.int64) * stride_se + (offs_n[None, :] // SCALE_BN) * stride_sn
                     + (tl.min(offs_k, axis=0) // SCALE_BK) * stride_sk)
            scale = tl.load(scale_ptr + s_off, mask=offs_n[None, :] < N, other=0.0)
        else:
            s_off = (expert.to(tl.int64) * stride_se + (offs_n[None, :] // SCALE_BN) * stride_sn
                     + (offs_k[:, None] // SCALE_BK) * stride_sk)
            scale = tl.load(scale_ptr + s_off, mask=mask, other=0.0)
        w = (w.to(tl.float32) * scale).to(COMPUTE)
    return w


@triton.jit
def _fp8_scale_row(scale_ptr, expert, k0, n0, N, stride_se, stride_sn, stride_sk, SCALE_BN: tl.constexpr,
                   SCALE_BK: tl.constexpr, BLOCK_N: tl.constexpr, ONE_W_SCALE: tl.constexpr):
    """The fp32 weight scales of columns n0 .. n0 + BLOCK_N at input row k0, as a [1, BLOCK_N] row, or, with
    ONE_W_SCALE (the tile lies inside one scale block: 128 x 128 blocks, BLOCK_N <= 128), one scalar: one load
    and no registers for a row of equal values (without it gate/up spills 16 B on sm_89). Per tensor /
    channel: SCALE_BN = SCALE_BK = 1, strides 0 where constant."""
    base = scale_ptr + expert.to(tl.int64) * stride_se + (k0 // SCALE_BK) * stride_sk
    if ONE_W_SCALE:
        scale = tl.load(base + (n0 // SCALE_BN) * stride_sn)
    else:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        scale = tl.load(base + (offs_n // SCALE_BN) * stride_sn, mask=offs_n < N, other=0.0)[None, :]
    return scale


@triton.jit
def _dot(a, b, acc, UPCAST_DOT: tl.constexpr):
    if UPCAST_DOT:  # fp32 activations (exact, not tf32), or bf16 under the interpreter (see launcher)
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _moe_gemm_kernel(a_ptr, out_ptr, w_ptr, scale_ptr, zero_ptr, g_idx_ptr, routing_weight_ptr,
                     sorted_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
                     num_valid, N, K, up_offset, a_row_divisor,
                     stride_am, stride_om,
                     stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, group_size,
                     GATE_UP: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
                     HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, TILE_SCALE_ROW: tl.constexpr,
                     SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, FP8_AS_BITS: tl.constexpr,
                     UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     bias_ptr, stride_be, swiglu_alpha, swiglu_limit, HAS_BIAS: tl.constexpr = False,
                     CLAMPED_SWIGLU: tl.constexpr = False, a_scale_ptr=None, stride_asm=0, stride_asg=0,
                     A_GROUP: tl.constexpr = 1, A_FP8: tl.constexpr = False, SCALE_PER_TILE: tl.constexpr = False,
                     ONE_W_SCALE: tl.constexpr = False):
    """One program: BLOCK_M sorted rows (one expert) x BLOCK_N output columns.

    A row of sorted row r is sorted_ids[r] // a_row_divisor (the token for gate/up, the
    (token, slot) row itself for down); the output row is sorted_ids[r].
    GATE_UP: out[:, n] = silu(A @ W[n]) * (A @ W[n + up_offset]); else out = w_route * (A @ W^T).
    HAS_BIAS: bias [E, N (+ up_offset)] (stride_be per expert) added to each GEMM output first;
    CLAMPED_SWIGLU: gpt-oss's activation (`ClampedSwiGLU`) in place of SiLU-and-mul.
    A_FP8 (W8A8, fp8 experts on sm_89+): A is e4m3 with fp32 scales a_scale[row, k // A_GROUP] (strides 0 for a
    static scale), W the e4m3 codes; e4m3 x e4m3 dots accumulate in fp32. Block-scaled weights (SCALE_PER_TILE:
    BLOCK_K divides SCALE_BK = A_GROUP) scale each K tile's partial sum by a_scale * w_scale; per-tensor /
    per-channel weights scale the accumulators once, after the K loop. ONE_W_SCALE: every N tile (the up
    half's too) lies inside one weight scale block (`_fp8_scale_row`).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return  # past the last padded expert run: max_blocks is only an upper bound
    expert = tl.load(expert_ids_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_ok = rows < num_valid  # padding slots hold the sentinel num_valid
    a_rows = (rows // a_row_divisor).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    COMPUTE = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        w = _load_weight_tile(w_ptr, scale_ptr, zero_ptr, g_idx_ptr, expert, offs_k, offs_n, K, N,
                              stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, group_size,
                              KIND, BITS, HAS_ZEROS, HAS_G_IDX, TILE_SCALE_ROW, SCALE_BN, SCALE_BK, FP8_AS_BITS,
                              COMPUTE, A_FP8)
        if A_FP8 and SCALE_PER_TILE:  # block scales: this K tile's partial sum, scaled by a_scale * w_scale
            a_scale = tl.load(a_scale_ptr + a_rows * stride_asm + (k0 // A_GROUP) * stride_asg, mask=row_ok,
                              other=0.0)
            w_scale = _fp8_scale_row(scale_ptr, expert, k0, pid_n * BLOCK_N, N, stride_se, stride_sn, stride_sk,
                                     SCALE_BN, SCALE_BK, BLOCK_N, ONE_W_SCALE)
            acc += tl.dot(a, w) * (a_scale[:, None] * w_scale)
        else:
            acc = _dot(a, w, acc, UPCAST_DOT)
        if GATE_UP:
            w_up = _load_weight_tile(w_ptr, scale_ptr, zero_ptr, g_idx_ptr, expert, offs_k,
                                     offs_n + up_offset, K, N + up_offset,
                                     stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                                     group_size, KIND, BITS, HAS_ZEROS, HAS_G_IDX, TILE_SCALE_ROW,
                                     SCALE_BN, SCALE_BK, FP8_AS_BITS, COMPUTE, A_FP8)
            if A_FP8 and SCALE_PER_TILE:
                w_scale_up = _fp8_scale_row(scale_ptr, expert, k0, pid_n * BLOCK_N + up_offset, N + up_offset,
                                            stride_se, stride_sn, stride_sk, SCALE_BN, SCALE_BK, BLOCK_N, ONE_W_SCALE)
                acc_up += tl.dot(a, w_up) * (a_scale[:, None] * w_scale_up)
            else:
                acc_up = _dot(a, w_up, acc_up, UPCAST_DOT)
    if A_FP8 and not SCALE_PER_TILE:  # per-token (or static) and per-tensor / per-channel scales: constant along K
        a_scale = tl.load(a_scale_ptr + a_rows * stride_asm, mask=row_ok, other=0.0)[:, None]
        acc *= a_scale * _fp8_scale_row(scale_ptr, expert, 0, pid_n * BLOCK_N, N, stride_se, stride_sn, stride_sk,
                                        SCALE_BN, SCALE_BK, BLOCK_N, ONE_W_SCALE)
        if GATE_UP:
            acc_up *= a_scale * _fp8_scale_row(scale_ptr, expert, 0, pid_n * BLOCK_N + up_offset, N + up_offset,
                                               stride_se, stride_sn, stride_sk, SCALE_BN, SCALE_BK, BLOCK_N, ONE_W_SCALE)
    if HAS_BIAS:
        bias_row = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(bias_row + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if GATE_UP:
            acc_up += tl.load(bias_row + up_offset + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if GATE_UP:
        if CLAMPED_SWIGLU:  # (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)
            gate = tl.minimum(acc, swiglu_limit)
            up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
            acc = gate / (1.0 + tl.exp(-swiglu_alpha * gate)) * (up + 1.0)
        else:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up, in fp32
    else:
        acc = acc * tl.load(routing_weight_ptr + rows, mask=row_ok, other=0.0)[:, None]
    out_mask = row_ok[:, None] & (offs_n[None, :] < N)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class MoEConfig:
    """Launch config of one _moe_gemm_kernel GEMM (the fields of its tuned JSON entry)."""
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


# Defaults by tokens per expert (T * k / E), checked by AOT to compile without register spills
# on sm_80 and sm_90 for dense, int4 and fp8 weights.
DEFAULT_CONFIGS = (  # (min tokens per expert, config)
    (0, MoEConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)),
    (16, MoEConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)),
    (64, MoEConfig(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)),
)


def config_bucket(tokens: int, num_experts: int, N: int, K: int) -> str:
    """Key of a tuned configs/moe/<gpu>.json entry for one of the two GEMMs (gate/up: N = I, K = D;
    down: N = D, K = I): tokens rounded up to a power of two, exact E, N, K."""
    return f"M{triton.next_power_of_2(tokens)}_E{num_experts}_N{N}_K{K}"


def default_config(tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    """The default in code for this many tokens per expert."""
    per_expert = tokens * top_k / num_experts
    return [config for threshold, config in DEFAULT_CONFIGS if per_expert >= threshold][-1]


def _config(tokens: int, top_k: int, num_experts: int, N: int, K: int) -> MoEConfig:
    """Tuned config for this GEMM's shape bucket, else the default for its tokens per expert."""
    return tuned_or_default("moe", config_bucket(tokens, num_experts, N, K),
                            default_config(tokens, top_k, num_experts))


def check_config(config) -> tuple[MoEConfig, MoEConfig]:
    """A MoEConfig (both GEMMs) or a (gate_up, down) pair -> the pair; ValueError if not launchable."""
    pair = (config, config) if isinstance(config, MoEConfig) else config
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(c, MoEConfig) for c in pair)):
        raise ValueError(f"fused_moe: config must be a MoEConfig or a (gate_up, down) pair of them, "
                         f"got {type(config).__name__}")
    for c in pair:
        check_launch_config("fused_moe", c, MoEConfig)
    if pair[0].BLOCK_M != pair[1].BLOCK_M:
        raise ValueError(f"fused_moe: the gate_up and down configs have BLOCK_M {pair[0].BLOCK_M} and "
                         f"{pair[1].BLOCK_M}; both GEMMs share one token alignment, so BLOCK_M must match")
    return pair


def _weight_args(w: Weight, native_fp8: bool) -> dict:
    """Kernel arguments describing a stacked weight whose per-expert matrix is W [N, K]."""
    if isinstance(w, DenseWeight):
        t = w.weight
        return dict(w_ptr=t, scale_ptr=t, zero_ptr=t, g_idx_ptr=t, stride_we=t.stride(0), stride_wn=t.stride(1),
                    stride_wk=t.stride(2), stride_se=0, stride_sn=0, stride_sk=0, group_size=1,
                    KIND=DENSE, BITS=4, HAS_ZEROS=False, HAS_G_IDX=False, SCALE_BN=1, SCALE_BK=1, FP8_AS_BITS=False)
    if isinstance(w, Int4Weight):
        q, s = w.qweight, w.scales
        return dict(w_ptr=q, scale_ptr=s, zero_ptr=s if w.zeros is None else w.zeros,
                    g_idx_ptr=q if w.g_idx is None else w.g_idx,
                    stride_we=q.stride(0), stride_wn=q.stride(2), stride_wk=q.stride(1),
                    stride_se=s.stride(0), stride_sn=s.stride(2), stride_sk=s.stride(1), group_size=w.group_size,
                    KIND=INT4, BITS=w.bits, HAS_ZEROS=w.zeros is not None, HAS_G_IDX=w.g_idx is not None,
                    SCALE_BN=1, SCALE_BK=1, FP8_AS_BITS=False)
    if isinstance(w, MXFP4Weight):
        b, s = w.blocks, w.scales
        return dict(w_ptr=b, scale_ptr=s, zero_ptr=s, g_idx_ptr=s, stride_we=b.stride(0), stride_wn=b.stride(1),
                    stride_wk=1, stride_se=s.stride(0), stride_sn=s.stride(1), stride_sk=s.stride(2), group_size=32,
                    KIND=MXFP4, BITS=4, HAS_ZEROS=False, HAS_G_IDX=False, SCALE_BN=1, SCALE_BK=1, FP8_AS_BITS=False)
    t, s = w.weight, w.weight_scale.float()
    if w.block_size is not None:
        scale_bn, scale_bk = w.block_size
        strides = (s.stride(0), s.stride(1), s.stride(2))
    elif s.dim() == 1:  # per tensor: one scale per expert
        scale_bn, scale_bk, strides = 1, 1, (s.stride(0), 0, 0)
    else:  # per channel [E, N, 1]
        scale_bn, scale_bk, strides = 1, 1, (s.stride(0), s.stride(1), 0)
    return dict(w_ptr=t if native_fp8 else t.view(torch.uint8), scale_ptr=s, zero_ptr=s, g_idx_ptr=s,
                stride_we=t.stride(0), stride_wn=t.stride(1),
                stride_wk=t.stride(2), stride_se=strides[0], stride_sn=strides[1], stride_sk=strides[2],
                group_size=1, KIND=FP8, BITS=4, HAS_ZEROS=False, HAS_G_IDX=False,
                SCALE_BN=scale_bn, SCALE_BK=scale_bk, FP8_AS_BITS=not native_fp8)


def _stacked_shape(w: Weight, name: str) -> tuple[int, int, int]:
    """(E, N, K) of a stacked weight, validating its fields have the leading expert dim."""
    if not isinstance(w, WEIGHT_TYPES):
        raise ValueError(f"fused_moe: {name} must be a stacked DenseWeight/Int4Weight/FP8Weight with a leading "
                         f"expert dim (loader.get_stacked), got {type(w).__name__}")
    E, N, K = w.stacked_shape(f"fused_moe: {name}")
    if w.bias is not None and (w.bias.shape != (E, N) or not w.bias.is_contiguous()):
        raise ValueError(f"fused_moe: {name} bias has shape {tuple(w.bias.shape)}; expected a contiguous [E={E}, "
                         f"N={N}] (one bias row per expert, as gpt-oss's gate_up_proj_bias / down_proj_bias)")
    return E, N, K


def _check_moe(x, gate_up, down, topk_weights, topk_ids) -> tuple[int, int, int]:
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fused_moe: x must be [T, D] fp16/bf16/fp32, got {tuple(x.shape)} {x.dtype}")
    T, D = x.shape
    E, two_i, gu_k = _stacked_shape(gate_up, "gate_up")
    E2, down_n, inter = _stacked_shape(down, "down")
    if gu_k != D or two_i != 2 * inter or down_n != D or E2 != E:
        raise ValueError(f"fused_moe: expected gate_up [E, 2I, D] and down [E, D, I] for x [T, D={D}], got "
                         f"gate_up [{E}, {two_i}, {gu_k}] and down [{E2}, {down_n}, {inter}]")
    devices = {t.device for t in (x, topk_weights, topk_ids, *gate_up.tensors().values(), *down.tensors().values())}
    if len(devices) > 1:
        raise ValueError("fused_moe: x, routing and expert weights must be on one device, "
                         f"found {sorted(map(str, devices))}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: topk_weights and topk_ids must both be [T={T}, k], got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    return E, inter, D


def fp8_w8a8(w: Weight, x: torch.Tensor) -> bool:
    """Whether fused_moe runs its GEMM over the stacked experts w as W8A8 (e4m3 activations x e4m3 codes) for
    activations like x: FP8 experts whose checkpoint quantizes activations (not w.weight_only, which e.g.
    compressed-tensors' `input_activations: null` sets), on a kernel with e4m3 tensor cores
    (`has_fp8_tensor_cores`: CUDA sm_89+, meta tensors (AOT), Triton's interpreter), and, for block weights, a
    K block that is a power of two >= FP8_DOT_MIN_K (real checkpoints: 128). Otherwise weight-only (codes
    dequantized to x.dtype in the kernel): below sm_89, and on the CPU backend and the CPU torch reference,
    which have no fp8 GEMM (as fp8_gemm's CPU path)."""
    if not isinstance(w, FP8Weight) or w.weight_only:
        return False
    if w.block_size is not None and (w.block_size[1] < FP8_DOT_MIN_K or w.block_size[1] & (w.block_size[1] - 1)):
        return False
    return (on_gpu(x) or use_triton(x)) and has_fp8_tensor_cores(x.device)


def fp8_activation_scheme(w: FP8Weight) -> tuple[int | None, torch.Tensor | None]:
    """(group_size, input_scale) for `quantize_activation_fp8` of a W8A8 GEMM's input over stacked fp8 experts w,
    as the checkpoint says: per 1 x bk group for block weights (block_size (bn, bk)), else per token (None);
    a static checkpoint's per-expert input_scale [E] becomes one scale, the largest (every expert's input stays
    in range; the input is quantized once, before the tokens are sorted by expert; as vLLM)."""
    group = w.block_size[1] if w.block_size is not None else None
    return group, None if w.input_scale is None else w.input_scale.float().max()


def _fit_block_k(config: MoEConfig, w: Weight, w8a8: bool) -> MoEConfig:
    """A default or tuned config with BLOCK_K narrowed to a W8A8 block weight's K block (a tile in one block)."""
    if w8a8 and w.block_size is not None and config.BLOCK_K > w.block_size[1]:
        return replace(config, BLOCK_K=w.block_size[1])
    return config


def fused_moe(x: torch.Tensor, gate_up: Weight, down: Weight, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoEConfig | tuple[MoEConfig, MoEConfig] | None = None,
              activation: ClampedSwiGLU | None = None, weight_only: bool | None = None) -> torch.Tensor:
    """x [T, D] -> [T, D] in x.dtype: sum_k topk_weights[:, k] * down_e(silu(gate_e x) * up_e x).

    Biases of the stacked weights (if any) are added to each GEMM's output; activation: None
    (SiLU-and-mul) or ClampedSwiGLU (gpt-oss).

    config: one MoEConfig for both GEMMs or a (gate_up, down) pair with equal BLOCK_M (the
    tuner's candidates); None: each GEMM's tuned config (`_config`), sharing the smaller BLOCK_M.
    FP8 experts: each GEMM runs W8A8 where `fp8_w8a8` says (its input quantized per token or per 1 x bk group,
    `fp8_activation_scheme`), else weight-only; weight_only=True forces weight-only (tests, benchmarks).
    """
    E, inter, D = _check_moe(x, gate_up, down, topk_weights, topk_ids)
    explicit = check_config(config) if config is not None else None
    if activation is not None and not isinstance(activation, ClampedSwiGLU):
        raise ValueError(f"fused_moe: activation must be None (SiLU-and-mul) or a ClampedSwiGLU, got {activation!r}")
    if weight_only not in (None, True):
        raise ValueError(f"fused_moe: weight_only must be None (W8A8 where `fp8_w8a8` says) or True, got {weight_only!r}")
    if use_cpu_kernels(x):  # per expert, torch's CPU kernels over weights prepared once (cpu_lowbit)
        return cpu_lowbit.fused_moe(x, gate_up, down, topk_weights, topk_ids, activation)
    w8a8 = (False, False) if weight_only else (fp8_w8a8(gate_up, x), fp8_w8a8(down, x))
    if not use_triton(x):
        return fused_moe_reference(x, gate_up, down, topk_weights, topk_ids, activation, w8a8)
    T, top_k = topk_ids.shape
    if T == 0:
        return x.new_zeros(T, D)
    x = x.contiguous()
    numel = T * top_k
    cfg1, cfg2 = explicit or (_fit_block_k(_config(T, top_k, E, inter, D), gate_up, w8a8[0]),
                              _fit_block_k(_config(T, top_k, E, D, inter), down, w8a8[1]))
    # Both GEMMs share one alignment, so they use the smaller BLOCK_M of the two configs.
    block_m = min(cfg1.BLOCK_M, cfg2.BLOCK_M)
    # Slots of other ranks' experts (-1) go to a virtual expert E, sorted last; the kernels stop before its
    # blocks (num_tokens_post_padded less its padded run), so those rows stay zero. No host read.
    dropped = topk_ids < 0
    sorted_ids, expert_ids, post_padded = moe_align_block_size(torch.where(dropped, E, topk_ids), block_m, E + 1)
    post_padded = post_padded - (dropped.sum(dtype=torch.int32) + block_m - 1) // block_m * block_m
    routing = topk_weights.float().contiguous().flatten()
    alignment = (sorted_ids, expert_ids, post_padded)
    native_fp8 = has_fp8_tensor_cores(x.device)
    hidden = torch.empty(numel, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(numel, D, dtype=x.dtype, device=x.device)  # zeros: the rows of dropped slots stay 0
    # W8A8: each GEMM's input quantized once, row by row (x per token; hidden per (token, slot) row)
    a, a_scale = quantize_activation_fp8(x, *fp8_activation_scheme(gate_up)) if w8a8[0] else (x, None)
    moe_gemm_launch(a, hidden, gate_up, routing, alignment, top_k, cfg1, block_m, True, native_fp8, activation,
                    a_scale)()
    a, a_scale = quantize_activation_fp8(hidden, *fp8_activation_scheme(down)) if w8a8[1] else (hidden, None)
    moe_gemm_launch(a, out, down, routing, alignment, top_k, cfg2, block_m, False, native_fp8, None, a_scale)()
    return out.view(T, top_k, D).sum(1, dtype=torch.float32).to(x.dtype)


def moe_gemm_launch(a: torch.Tensor, out: torch.Tensor, weight: Weight, routing: torch.Tensor, alignment: tuple,
                    top_k: int, config: MoEConfig, block_m: int, gate_up: bool, native_fp8: bool,
                    activation: ClampedSwiGLU | None = None, a_scale: torch.Tensor | None = None) -> Launch:
    """The launch of _moe_gemm_kernel for one of the two GEMMs, over all experts.

    gate_up: a = x [T, D], weight [E, 2I, D], out = hidden [T*k, I] (SiLU-and-mul fused); else
    a = hidden [T*k, I], weight [E, D, I], out [T*k, D] times the routing weights [T*k] fp32.
    alignment: (sorted_ids, expert_ids, num_tokens_post_padded) of `moe_align_block_size(.., block_m)`.
    native_fp8: load fp8 weights as float8e4nv (`has_fp8_tensor_cores`), else decode their bytes.
    weight.bias [E, N_w] (if any) is added to the GEMM output; activation (gate_up only): ClampedSwiGLU or
    None (SiLU-and-mul). Over meta tensors this is the launch tune --aot compiles.
    a_scale (W8A8, fp8 experts with fp8 tensor cores): a is e4m3 from `fp8_gemm.quantize_activation_fp8` and
    a_scale its fp32 scales ([rows, 1] per token, [rows, ceil(K/bk)] per 1 x bk group for block weights, []
    static); the weight's codes are loaded as e4m3 (native_fp8 must be True) and the dot runs in e4m3.
    """
    sorted_ids, expert_ids, post_padded = alignment
    N, K = out.shape[1], a.shape[1]
    if isinstance(weight, MXFP4Weight) and config.BLOCK_K % 32:
        raise ValueError(f"fused_moe: BLOCK_K={config.BLOCK_K} with MXFP4 experts; it must be a multiple of the "
                         "32-element scale group (use 32, 64 or 128)")
    w8a8 = a_scale is not None
    if w8a8:
        _check_w8a8_launch(a, weight, config, native_fp8)
    block_scaled = w8a8 and weight.block_size is not None
    a_scale_strides = (0, 0) if not w8a8 or a_scale.dim() == 0 else a_scale.stride()
    args = dict(a_ptr=a, out_ptr=out, routing_weight_ptr=routing, sorted_ids_ptr=sorted_ids,
                expert_ids_ptr=expert_ids, num_tokens_post_padded_ptr=post_padded,
                num_valid=routing.numel(), N=N, K=K, up_offset=N if gate_up else K,  # the I of gate_up
                a_row_divisor=top_k if gate_up else 1, stride_am=a.stride(0), stride_om=out.stride(0),
                GATE_UP=gate_up, TILE_SCALE_ROW=weight.scales_constant_over(config.BLOCK_K), UPCAST_DOT=upcast_dot(a),
                BLOCK_M=block_m, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K, **_weight_args(weight, native_fp8),
                bias_ptr=routing if weight.bias is None else weight.bias,
                stride_be=0 if weight.bias is None else weight.bias.stride(0),
                swiglu_alpha=activation.alpha if activation else 1.0, swiglu_limit=activation.limit if activation else 0.0,
                HAS_BIAS=weight.bias is not None, CLAMPED_SWIGLU=activation is not None,
                a_scale_ptr=a_scale if w8a8 else routing, stride_asm=a_scale_strides[0], stride_asg=a_scale_strides[1],
                A_GROUP=weight.block_size[1] if block_scaled else K, A_FP8=w8a8, SCALE_PER_TILE=block_scaled,
                ONE_W_SCALE=block_scaled and weight.block_size[0] % config.BLOCK_N == 0
                and (not gate_up or N % weight.block_size[0] == 0))
    grid = (expert_ids.numel(), triton.cdiv(N, config.BLOCK_N))
    return Launch(_moe_gemm_kernel, grid, args, config.num_warps, config.num_stages)


def _check_w8a8_launch(a: torch.Tensor, weight: Weight, config: MoEConfig, native_fp8: bool) -> None:
    if not isinstance(weight, FP8Weight) or a.dtype != torch.float8_e4m3fn or not native_fp8:
        raise ValueError(f"fused_moe: W8A8 (a_scale given) needs FP8 experts, float8_e4m3fn activations and fp8 "
                         f"tensor cores (native_fp8), got {type(weight).__name__}, {a.dtype}, native_fp8={native_fp8}")
    if config.BLOCK_K < FP8_DOT_MIN_K or (weight.block_size is not None and weight.block_size[1] % config.BLOCK_K):
        raise ValueError(f"fused_moe: BLOCK_K={config.BLOCK_K} with W8A8 fp8 experts (block_size {weight.block_size}); "
                         f"it must be >= {FP8_DOT_MIN_K} (tl.dot's smallest e4m3 K) and divide the weight's K block, so "
                         "that a K tile lies inside one scale block")


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------

def fused_moe_reference(x: torch.Tensor, gate_up: Weight, down: Weight, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: ClampedSwiGLU | None = None,
                        w8a8: tuple[bool, bool] = (False, False)) -> torch.Tensor:
    """Loop over experts in float32: each expert runs its MLP (biases included) on the tokens routed to it.

    w8a8 (gate_up, down): that GEMM's input is rounded as the W8A8 kernel quantizes it (`fp8_activation_scheme`,
    `fp8_gemm.fp8_round_trip`; the hidden first rounded to x.dtype, the dtype the kernel stores it in)."""
    E, inter, D = _check_moe(x, gate_up, down, topk_weights, topk_ids)
    xf = fp8_round_trip(x, *fp8_activation_scheme(gate_up)) if w8a8[0] else x.float()
    out = torch.zeros(x.shape[0], D, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():  # -1: another rank's expert
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gu, dn = gate_up.expert(e), down.expert(e)
        gate, up = F.linear(xf[token], gu.dequantize(torch.float32), _float(gu.bias)).split(inter, dim=1)
        hidden = F.silu(gate) * up if activation is None else activation.apply(gate, up)
        if w8a8[1]:
            hidden = fp8_round_trip(hidden.to(x.dtype), *fp8_activation_scheme(down))
        y = F.linear(hidden, dn.dequantize(torch.float32), _float(dn.bias))
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    return out.to(x.dtype)


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


# ----------------------------------------------------------------------------------------------
# Tuning (python -m tritonq.tune --kernel moe): shapes TxExTOPKxDxI, int4 group-128 experts
# ----------------------------------------------------------------------------------------------

# Values the tuner sweeps (the fields of MoEConfig); `sweep_space` keeps those useful for a GEMM.
CONFIG_SPACE = {"BLOCK_M": [16, 32, 64], "BLOCK_N": [64, 128], "BLOCK_K": [64, 128], "num_warps": [4, 8],
                "num_stages": [2, 3]}
TUNE_FORMAT = "TxExTOPKxDxI"
TUNE_GEMMS = ("gate_up", "down")  # a tuning problem is (T, E, TOPK, D, I, index into TUNE_GEMMS)


def tune_problem(shape) -> tuple[int, ...]:
    """(T, E, TOPK, D, I, gemm) checked: TOPK <= E; D and I multiples of 32 (int4 groups)."""
    *dims, gemm = shape if len(shape) == 6 else (*shape, 0)
    T, E, top_k, D, inter = unpack_shape(tuple(dims), "moe", TUNE_FORMAT)
    if top_k > E or D % 32 or inter % 32 or gemm not in (0, 1):
        raise ValueError(f"moe shape {'x'.join(map(str, dims))} ({TUNE_FORMAT}): needs TOPK <= E and D, I "
                         f"multiples of 32 (int4 group size)")
    return T, E, top_k, D, inter, gemm


def sweep_space(problem) -> list[dict]:
    """BLOCK_M up to the tokens per expert (rounded up); BLOCK_N, BLOCK_K up to the GEMM's N, K."""
    T, E, top_k, D, inter, gemm = tune_problem(problem)
    N, K = (inter, D) if gemm == 0 else (D, inter)
    max_m = max(16, triton.next_power_of_2(triton.cdiv(T * top_k, E)))
    out = []
    for values in itertools.product(*CONFIG_SPACE.values()):
        c = dict(zip(CONFIG_SPACE, values))
        if (c["BLOCK_M"] <= max_m and c["BLOCK_N"] <= max(64, triton.next_power_of_2(N))
                and c["BLOCK_K"] <= max(64, triton.next_power_of_2(K))):
            out.append(c)
    return out


# The expert layouts the packers give a MoE layer (and tritonq.random_weights.random_experts fills):
# "int4" / "fp8" (asymmetric group `tune_group_size`, 128x128 blocks: the tuner's and bench's), 8-bit
# (GPTQ 8-bit, W8A16), symmetric act-order (GPTQ desc_act), fp8 per channel / tensor, gpt-oss's mxfp4.
EXPERT_KINDS = ("dense", "int4", "fp8", "int8", "int4-act-order", "fp8-channel", "fp8-tensor", "mxfp4")


def meta_experts(kind: str, E: int, N: int, K: int, dtype: torch.dtype) -> Weight:
    """A stacked expert weight [E, N, K] of `kind` (EXPERT_KINDS) over meta tensors (shapes and dtypes, no
    memory): int4 / int8 asymmetric with groups of `tune_group_size(K)`, int4-act-order symmetric with g_idx
    [E, K], fp8 with 128x128 block scales, fp8-channel [E, N, 1] / fp8-tensor [E] scales, mxfp4 e2m1 blocks
    [E, N, K/32, 16] with E8M0 scales [E, N, K/32]."""
    meta = torch.device("meta")
    if kind == "dense":
        return DenseWeight(torch.empty(E, N, K, dtype=dtype, device=meta))
    if kind in ("int4", "int8", "int4-act-order"):
        bits = 8 if kind == "int8" else 4
        group_size = tune_group_size(K)
        qweight = torch.empty(E, K * bits // 32, N, dtype=torch.int32, device=meta)
        scales = torch.empty(E, K // group_size, N, dtype=dtype, device=meta)
        if kind == "int4-act-order":
            return Int4Weight(qweight, scales, None, torch.empty(E, K, dtype=torch.int32, device=meta), group_size, 4)
        return Int4Weight(qweight, scales, torch.empty_like(scales), None, group_size, bits)
    scale_shape = {"fp8": (E, triton.cdiv(N, 128), triton.cdiv(K, 128)), "fp8-channel": (E, N, 1),
                   "fp8-tensor": (E,)}.get(kind)
    if scale_shape is not None:
        return FP8Weight(torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=meta),
                         torch.empty(scale_shape, dtype=torch.float32, device=meta),
                         block_size=(128, 128) if kind == "fp8" else None)
    if kind == "mxfp4":
        return MXFP4Weight(torch.empty(E, N, K // 32, 16, dtype=torch.uint8, device=meta),
                           torch.empty(E, N, K // 32, dtype=torch.uint8, device=meta))
    raise ValueError(f"meta_experts: kind {kind!r}; choose one of {EXPERT_KINDS}")


def aot_launch(config: MoEConfig, problem, kind: str = "int4", native_fp8: bool = True,
               dtype: torch.dtype = torch.bfloat16, gpt_oss: bool = False, w8a8: bool = False) -> Launch:
    """`moe_gemm_launch` over meta tensors for one GEMM of a tuning problem: activations in dtype, experts
    of `kind` laid out as `meta_experts` gives them (fp8 loaded as float8e4nv if native_fp8, else decoded
    from their bytes). gpt_oss: expert biases and the ClampedSwiGLU epilogue. w8a8 (fp8 kinds, sm_89+): e4m3
    activations with fp32 scales per 1 x 128 group (block weights) or per token, as fused_moe."""
    from dataclasses import replace

    T, E, top_k, D, inter, gemm = tune_problem(problem)
    gate = gemm == 0
    N, K, w_rows = (inter, D, 2 * inter) if gate else (D, inter, D)  # w_rows: the stacked weight's N
    weight = meta_experts(kind, E, w_rows, K, dtype)
    if gpt_oss:
        weight = replace(weight, bias=torch.empty(E, w_rows, dtype=dtype, device="meta"))
    meta = torch.device("meta")
    numel = T * top_k
    max_blocks = min(numel, triton.cdiv(numel, config.BLOCK_M) + E)  # as moe_align_block_size
    alignment = (torch.empty(max_blocks * config.BLOCK_M, dtype=torch.int32, device=meta),
                 torch.empty(max_blocks, dtype=torch.int32, device=meta), torch.empty(1, dtype=torch.int32, device=meta))
    rows = T if gate else numel
    a = torch.empty(rows, K, dtype=torch.float8_e4m3fn if w8a8 else dtype, device=meta)
    a_scale = None
    if w8a8:
        group = weight.block_size[1] if weight.block_size is not None else K
        a_scale = torch.empty(rows, triton.cdiv(K, group), dtype=torch.float32, device=meta)
    out = torch.empty(numel, N, dtype=dtype, device=meta)
    routing = torch.empty(numel, dtype=torch.float32, device=meta)
    return moe_gemm_launch(a, out, weight, routing, alignment, top_k, config, config.BLOCK_M, gate, native_fp8,
                           ClampedSwiGLU() if gpt_oss and gate else None, a_scale)
