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
expert's run to BLOCK_M, so each M block of rows belongs to one expert (the expert GEMM's `jit.py`).
"""
from __future__ import annotations

import torch
import triton


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
