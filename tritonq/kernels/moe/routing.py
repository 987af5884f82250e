"""Routing and token alignment: which experts each token goes to, and the sort that groups the
(token, slot) pairs by expert for the expert GEMM.

Routing `grouped_topk(router_logits [T, E])` -> (topk_weights [T, k] fp32, topk_ids [T, k] int32)
covers DeepSeek-V2 `greedy` / `group_limited_greedy` (softmax, group score = max in group) and
DeepSeek-V3 `noaux_tc` (sigmoid, correction bias for selection only, group score = sum of the
top-2 in group). Ties: the lower expert (or group) index wins, via a stable descending sort
(torch.topk does not promise this: on CPU, zeros(1, 8).topk(2) returns indices [6, 5]).
grouped_topk is vectorised torch (the CPU and torch backends); `grouped_topk_reference` is an independent
per-token loop, the tests' oracle.

Token alignment: `moe_align_block_size` sorts the T*k (token, slot) pairs by expert and pads each
expert's run to BLOCK_M, so each M block of rows belongs to one expert (the expert GEMM's `jit.py`). Slots of
experts this process does not hold (id -1) sort after every expert, outside the counted rows. A decode-sized
problem (T*k x experts <= ALIGN_ONE_PROGRAM) aligns in one Triton launch, one program (`_moe_align_kernel`);
larger ones (prefill) and the CPU run the vectorised torch scans, whose ~20 launches are parallel over the pairs.

Both in one launch: `route_tokens` (what a MoE layer calls, through `MoEExperts.route`) routes with
`_route_kernel` on the Triton backend and, for a decode-sized problem, aligns the ids it just wrote in the same
program (`_align`, shared with `_moe_align_kernel`): one launch where softmax, sort, gather, renormalization,
scaling and the alignment were ~8 torch ops and a launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tritonq.kernels import backend
from tritonq.kernels.common import Launch, next_pow2

ALIGN_ONE_PROGRAM = 65536  # pairs x experts (the one-hot tile the program sweeps); e.g. 16 tokens x 8 slots x 512
ROUTE_TILE = 2048  # logits a routing program holds at once: [BLOCK_T, next_pow2(E)] fp32, 16 a thread at 4 warps


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


def route_tokens(router_logits: torch.Tensor, top_k: int, n_group: int = 1, topk_group: int = 1,
                 scoring: str = "softmax", correction_bias: torch.Tensor | None = None, renormalize: bool = False,
                 routed_scaling_factor: float = 1.0, *, block_m: int | None, num_experts: int | None = None,
                 first_expert: int = 0) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
    """grouped_topk, then moe_align_block_size over the experts this process holds, the global ids
    [first_expert, first_expert + num_experts) (None: all E) -> (topk_weights [T, k] fp32, topk_ids [T, k] int32 of
    the held experts, 0-based, -1 for the others; the alignment triple, None when block_m is None).

    Triton backend: `_route_kernel`; one launch routes and aligns a decode-sized problem (T*k x held experts <=
    ALIGN_ONE_PROGRAM), a larger one routes over cdiv(T, rows) programs, then aligns by torch scans. Every row is
    routed by the same code whatever T (batch invariant). Selection: softmax without a bias picks the largest logits
    (softmax is monotonic: gpt-oss's top-k of logits), else scores (+ bias); ties to the lower index, as grouped_topk.
    Softmax weights renormalized are the softmax of the chosen logits. Other backends: grouped_topk's torch ops."""
    _check_routing(router_logits, top_k, n_group, topk_group, scoring, correction_bias)
    E = router_logits.shape[1]
    num_experts = E if num_experts is None else num_experts
    if not (0 <= first_expert and 1 <= num_experts and first_expert + num_experts <= E):
        raise ValueError(f"route_tokens: held experts [{first_expert}, {first_expert + num_experts}) must lie in the "
                         f"router's {E} experts")
    if block_m is not None and (block_m < 1 or block_m & (block_m - 1)):
        raise ValueError(f"route_tokens: block_m={block_m} must be a power of two")
    if correction_bias is not None and correction_bias.device != router_logits.device:
        raise ValueError(f"route_tokens: correction_bias is on {correction_bias.device}, the router logits on "
                         f"{router_logits.device}; move it to the logits' device")
    if backend(router_logits) != "triton" or router_logits.shape[0] == 0:
        weights, ids = grouped_topk(router_logits, top_k, n_group, topk_group, scoring, correction_bias, renormalize,
                                    routed_scaling_factor)
        if first_expert or num_experts < E:
            ids -= first_expert
            ids = torch.where((ids >= 0) & (ids < num_experts), ids, -1)
        return weights, ids, None if block_m is None else moe_align_block_size(ids, block_m, num_experts)
    launch, (weights, ids, alignment) = route_launch(
        router_logits, correction_bias, top_k, n_group, topk_group, scoring, renormalize, routed_scaling_factor,
        block_m, num_experts, first_expert)
    launch()
    if block_m is not None and alignment is None:  # past one program: routed above, aligned by torch's scans
        alignment = moe_align_block_size(ids, block_m, num_experts)
    return weights, ids, alignment


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
    max_blocks = align_blocks(numel, block_m, num_experts)
    if backend(topk_ids) == "triton" and 0 < numel * next_pow2(num_experts + 1) <= ALIGN_ONE_PROGRAM:
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


def align_blocks(numel: int, block_m: int, num_experts: int) -> int:
    """The alignment's block count for numel pairs (moe_align_block_size): a bound without a host sync."""
    return min(numel, -(numel // -block_m) + num_experts + 1)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, post_padded_ptr,
                  T, E, stride_lt, per_group, scale, first_expert, num_local, max_blocks,
                  TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_EG: tl.constexpr,
                  BLOCK_K: tl.constexpr, ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """route_tokens: each program routes rows of BLOCK_T tokens (`_route_rows`), program p the p-th, p+grid-th...;
    ALIGN (block_m; 0: none, the grid is then any size) aligns the ids just written, in the same (single) program,
    once every thread's stores are in (the barrier)."""
    for row0 in range(tl.program_id(0) * BLOCK_T, T, tl.num_programs(0) * BLOCK_T):
        _route_rows(logits_ptr, bias_ptr, weights_ptr, ids_ptr, row0, T, E, stride_lt, per_group, scale,
                    first_expert, num_local, TOP_K, N_GROUP, TOPK_GROUP, SIGMOID, HAS_BIAS, RENORMALIZE, BLOCK_T,
                    BLOCK_EG, BLOCK_K)
    if ALIGN > 0:
        tl.debug_barrier()
        _align(ids_ptr, sorted_ids_ptr, expert_ids_ptr, post_padded_ptr, T * TOP_K, num_local, max_blocks, ALIGN,
               BLOCK_E, CHUNK)


@triton.jit
def _route_rows(logits_ptr, bias_ptr, weights_ptr, ids_ptr, row0, T, E, stride_lt, per_group, scale, first_expert,
                num_local, TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_EG: tl.constexpr, BLOCK_K: tl.constexpr):
    """grouped_topk of rows row0.. (fp32 [BLOCK_T, BLOCK_EG] tiles): the selection key (logits for softmax without a
    bias, else scores + bias), the kept groups (best score, or best two with a bias; TOPK_GROUP rounds of argmax
    over the groups), then TOP_K rounds of argmax, each the lowest index among equal keys, gathering its weight.
    Stores the weights and the ids shifted by first_expert (-1 outside the num_local held experts)."""
    rows = row0 + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_EG)
    row_ok = rows < T
    avail = (offs_e < E)[None, :] & (rows >= 0)[:, None]  # [BLOCK_T, BLOCK_EG]: the experts still choosable
    x = tl.load(logits_ptr + rows[:, None] * stride_lt + offs_e[None, :], mask=avail & row_ok[:, None],
                other=0.0).to(tl.float32)
    if SIGMOID:
        weigh = tl.sigmoid(x)
        key = weigh
    else:  # exp(x - max): softmax's numerator; divided by its row sum (or by the chosen ones') at the end
        weigh = tl.where(avail, tl.exp(x - tl.max(tl.where(avail, x, float("-inf")), 1)[:, None]), 0.0)
        total = tl.sum(weigh, 1)
        if HAS_BIAS:
            key = weigh / total[:, None]
        else:
            key = x
    if HAS_BIAS:
        key += tl.load(bias_ptr + offs_e, mask=offs_e < E, other=0.0).to(tl.float32)[None, :]
    if N_GROUP > 1:
        group = (offs_e // per_group)[None, :]  # lanes past E: group N_GROUP and beyond
        group_key = tl.zeros([BLOCK_T, BLOCK_EG], tl.float32)
        for g in range(N_GROUP):
            member = avail & (group == g)
            best = tl.max(tl.where(member, key, float("-inf")), 1)
            if HAS_BIAS:  # the sum of the group's best two
                first = tl.min(tl.where(member & (key == best[:, None]), offs_e[None, :], BLOCK_EG), 1)
                best += tl.max(tl.where(member & (offs_e[None, :] != first[:, None]), key, float("-inf")), 1)
            group_key = tl.where(member, best[:, None], group_key)
        kept = avail & (group < 0)
        for _ in range(TOPK_GROUP):
            free = avail & ~kept
            top = tl.max(tl.where(free, group_key, float("-inf")), 1)
            chosen = tl.min(tl.where(free & (group_key == top[:, None]), group, N_GROUP), 1)
            kept = kept | (group == chosen[:, None])
        avail = avail & kept
    offs_k = tl.arange(0, BLOCK_K)[None, :]
    weights = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for i in range(TOP_K):
        top = tl.max(tl.where(avail, key, float("-inf")), 1)
        pick = tl.min(tl.where(avail & (key == top[:, None]), offs_e[None, :], BLOCK_EG), 1)
        hit = offs_e[None, :] == pick[:, None]
        avail = avail & ~hit
        weights = tl.where(offs_k == i, tl.sum(tl.where(hit, weigh, 0.0), 1)[:, None], weights)
        ids = tl.where(offs_k == i, pick[:, None], ids)
    if RENORMALIZE:  # + 1e-20 as grouped_topk (underflowed sigmoid scores give 0); softmax's chosen sum >= 1
        weights = weights / (tl.sum(weights, 1)[:, None] + 1e-20)
    elif not SIGMOID:
        weights = weights / total[:, None]
    ids -= first_expert
    ids = tl.where((ids >= 0) & (ids < num_local), ids, -1)
    out = rows[:, None] * TOP_K + offs_k
    stored = row_ok[:, None] & (offs_k < TOP_K)
    tl.store(weights_ptr + out, weights * scale, mask=stored)
    tl.store(ids_ptr + out, ids, mask=stored)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, post_padded_ptr, numel, num_experts, max_blocks,
                      ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """moe_align_block_size in one program (`_align`)."""
    _align(ids_ptr, sorted_ids_ptr, expert_ids_ptr, post_padded_ptr, numel, num_experts, max_blocks, ALIGN, BLOCK_E,
           CHUNK)


@triton.jit
def _align(ids_ptr, sorted_ids_ptr, expert_ids_ptr, post_padded_ptr, numel, num_experts, max_blocks,
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
    block_e = next_pow2(num_experts + 1)
    args = dict(ids_ptr=topk_ids, sorted_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids, post_padded_ptr=post_padded,
                numel=topk_ids.numel(), num_experts=num_experts, max_blocks=max_blocks, ALIGN=block_m,
                BLOCK_E=block_e, CHUNK=max(16, 4096 // block_e))
    return Launch(_moe_align_kernel, (1,), args, 4, 1), (sorted_ids, expert_ids, post_padded)


def route_launch(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, n_group: int,
                 topk_group: int, scoring: str, renormalize: bool, routed_scaling_factor: float, block_m: int | None,
                 num_experts: int, first_expert: int
                 ) -> tuple[Launch, tuple[torch.Tensor, torch.Tensor, tuple | None]]:
    """The launch of _route_kernel (arguments as route_tokens, checked there) and the outputs it fills: weights, ids
    and, when block_m is given and the problem fits one program (ALIGN_ONE_PROGRAM), the alignment (else None)."""
    T, E = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty(T, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=device)
    block_eg, block_e = next_pow2(E), next_pow2(num_experts + 1)
    block_t = max(1, ROUTE_TILE // block_eg)
    align = block_m is not None and T * top_k * block_e <= ALIGN_ONE_PROGRAM
    max_blocks = align_blocks(T * top_k, block_m, num_experts) if align else 0
    sorted_ids = torch.empty(max_blocks * (block_m if align else 0), dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    post_padded = torch.empty(1 if align else 0, dtype=torch.int32, device=device)
    bias = router_logits if correction_bias is None else correction_bias.contiguous()
    args = dict(logits_ptr=router_logits, bias_ptr=bias, weights_ptr=weights, ids_ptr=ids, sorted_ids_ptr=sorted_ids,
                expert_ids_ptr=expert_ids, post_padded_ptr=post_padded, T=T, E=E, stride_lt=router_logits.stride(0),
                per_group=E // n_group, scale=float(routed_scaling_factor), first_expert=first_expert,
                num_local=num_experts, max_blocks=max_blocks, TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group,
                SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None, RENORMALIZE=bool(renormalize),
                BLOCK_T=block_t, BLOCK_EG=block_eg, BLOCK_K=next_pow2(top_k), ALIGN=block_m if align else 0,
                BLOCK_E=block_e, CHUNK=max(16, 4096 // block_e))
    grid = (1,) if align else (-(T // -block_t),)
    alignment = (sorted_ids, expert_ids, post_padded) if align else None
    return Launch(_route_kernel, grid, args, 4, 1), (weights, ids, alignment)
