"""Routing and token alignment: which experts each token goes to, and the sort that groups the
(token, slot) pairs by expert for the expert GEMM.

Routing `grouped_topk(router_logits [T, E])` -> (topk_weights [T, k] fp32, topk_ids [T, k] int32)
covers DeepSeek-V2 `greedy` / `group_limited_greedy` (softmax, group score = max in group) and
DeepSeek-V3 `noaux_tc` (sigmoid, correction bias for selection only, group score = sum of the
top-2 in group). Ties: the lower expert (or group) index wins, via a stable descending sort
(torch.topk does not promise this: on CPU, zeros(1, 8).topk(2) returns indices [6, 5]).
Routing is a handful of vectorised torch ops on a [T, E] fp32 tensor (E <= 256): a Triton
kernel would save a few microseconds of launches per layer and is not worth a second
implementation; `grouped_topk_reference` is an independent per-token loop.

Token alignment: `moe_align_block_size` sorts the T*k (token, slot) pairs by expert and pads each
expert's run to BLOCK_M, so each M block of rows belongs to one expert (the expert GEMM's `jit.py`). Slots of
experts this process does not hold (id -1) sort after every expert, outside the counted rows. A decode-sized
problem (T*k x experts <= ALIGN_ONE_PROGRAM) aligns in one Triton launch, one program (`_moe_align_kernel`);
larger ones (prefill) and the CPU run the vectorised torch scans, whose ~20 launches are parallel over the pairs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonq.kernels import backend
from tritonq.kernels.common import Launch

ALIGN_ONE_PROGRAM = 65536  # pairs x experts (the one-hot tile the program sweeps); e.g. 16 tokens x 8 slots x 512


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


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (ids in 0..num_experts-1, or -1: a slot not computed here) -> (sorted_ids, expert_ids,
    num_tokens_post_padded [1] int32).

    sorted_ids [max_blocks * block_m] int32: flat (token * k + slot) indices grouped by expert, in token order
      within an expert, each expert's run padded to a multiple of block_m with the sentinel T * k; the -1 slots
      come last, after num_tokens_post_padded rows.
    expert_ids [max_blocks] int32: the expert of each block of block_m rows (< num_tokens_post_padded).
    max_blocks = min(T*k, ceil(T*k / block_m) + E + 1) bounds the blocks without a host sync; blocks at or
    past num_tokens_post_padded are unused (the kernel exits on them). No host read either way, so a decode
    step can be CUDA-graph captured: one Triton launch for a decode-sized problem (module docstring), else
    vectorised torch (a stable sort and a few scans; scatter_add, not bincount).
    """
    numel = topk_ids.numel()
    max_blocks = min(numel, triton.cdiv(numel, block_m) + num_experts + 1)
    if backend(topk_ids) == "triton" and numel * triton.next_power_of_2(num_experts + 1) <= ALIGN_ONE_PROGRAM:
        launch, outputs = align_launch(topk_ids.contiguous(), block_m, num_experts, max_blocks)
        launch()
        return outputs
    flat = topk_ids.flatten().long()
    flat = torch.where(flat < 0, num_experts, flat)  # the slots not computed here: a virtual last expert
    device = flat.device
    order = torch.sort(flat, stable=True).indices             # pairs grouped by expert, token order kept
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(0, flat,
                                                                                       torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    unpadded_start = counts.cumsum(0) - counts
    expert_of_sorted = flat[order]
    rank_in_expert = torch.arange(numel, device=device) - unpadded_start[expert_of_sorted]
    sorted_ids = torch.full((max_blocks * block_m,), numel, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert_of_sorted] + rank_in_expert] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_start[-1:].to(torch.int32)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, post_padded_ptr, numel, num_experts, max_blocks,
                      ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """One program aligns all T*k pairs (moe_align_block_size; ALIGN is its block_m): counts per expert (a one-hot
    [CHUNK, BLOCK_E] summed over CHUNK pairs at a time; -1 ids count for the virtual expert num_experts), padded run
    starts by a cumsum, then each pair goes to its run's start + the pairs of its expert before it (earlier chunks,
    then a cumsum within the chunk), so the order within an expert is the token order; finally each block's expert."""
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, numel, CHUNK):
        onehot, _, _ = _align_chunk(ids_ptr, start, numel, num_experts, offs_e, BLOCK_E, CHUNK)
        counts += tl.sum(onehot, 0)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(post_padded_ptr, tl.sum(tl.where(offs_e == num_experts, starts, 0), 0))  # the dropped run's start
    for start in range(0, max_blocks * ALIGN, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.zeros([CHUNK], tl.int32) + numel, mask=offs < max_blocks * ALIGN)
    tl.debug_barrier()  # the sentinel fill lands before the scatter below overwrites parts of it
    seen = starts
    for start in range(0, numel, CHUNK):
        onehot, offs, ok = _align_chunk(ids_ptr, start, numel, num_experts, offs_e, BLOCK_E, CHUNK)
        position = tl.sum(onehot * (tl.cumsum(onehot, 0) - onehot + seen[None, :]), 1)
        tl.store(sorted_ids_ptr + position, offs, mask=ok)
        seen += tl.sum(onehot, 0)
    for start in range(0, max_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        expert = tl.sum((ends[None, :] <= (blocks * ALIGN)[:, None]).to(tl.int32), 1)  # searchsorted, right
        tl.store(expert_ids_ptr + blocks, tl.minimum(expert, num_experts - 1), mask=blocks < max_blocks)


@triton.jit
def _align_chunk(ids_ptr, start, numel, num_experts, offs_e, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """(one-hot [CHUNK, BLOCK_E] int32 of pairs start.. by expert (-1: num_experts; none past numel), the pairs'
    indices, which exist)."""
    offs = start + tl.arange(0, CHUNK)
    ok = offs < numel
    expert = tl.load(ids_ptr + offs, mask=ok, other=0)
    expert = tl.where(expert < 0, num_experts, expert)
    expert = tl.where(ok, expert, BLOCK_E)  # matches no lane
    return (expert[:, None] == offs_e[None, :]).to(tl.int32), offs, ok


def align_launch(topk_ids: torch.Tensor, block_m: int, num_experts: int, max_blocks: int
                 ) -> tuple[Launch, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The launch of _moe_align_kernel over contiguous topk_ids and moe_align_block_size's outputs it fills: one
    program, 4 warps, CHUNK pairs a step so that the one-hot tile holds 4096 values (32 a thread)."""
    device = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    post_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts + 1)
    args = dict(ids_ptr=topk_ids, sorted_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids, post_padded_ptr=post_padded,
                numel=topk_ids.numel(), num_experts=num_experts, max_blocks=max_blocks, ALIGN=block_m,
                BLOCK_E=block_e, CHUNK=max(16, 4096 // block_e))
    return Launch(_moe_align_kernel, (1,), args, 4, 1), (sorted_ids, expert_ids, post_padded)
