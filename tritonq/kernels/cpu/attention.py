"""CPU backend for paged attention and the KV write (shapes as kernels/attention/), in place of the references,
which gather whole block tables in unfused float32 ops (TRITONQ_BACKEND=torch still runs them: the test oracle).

Plain pages in q's dtype (no sinks, ALiBi or 8-bit pages, Dqk == Dv) go to the C kernel of kernels/cpu/native.py,
which reads the keys in place, the whole batch in one call per layer. Everything else, or without the library:
torch's CPU flash kernel over each sequence's real keys, gathered by a plan shared by a step's layers (`key_plan`)
and, on several threads, run in padded groups of similar lengths (`KeyGroup`); numerics as the Triton kernels'.
The design and its measurements: docs/cpu.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tritonq.kernels import threads_for
from tritonq.kernels.cpu import native as cpu_native

PARALLEL_WORK = 1 << 20  # query heads x query rows x keys of a sequence from which its op runs multithreaded
GROUPED_WORK = 1 << 16  # query heads x keys of a decode step from which it runs in padded groups on torch's threads
GROUP_KEYS = 4096  # a decode group's padded keys (sequences x its longest) at most
PADDING_SLACK = 1.25  # a decode group's padded keys over its real keys at most


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, cache_lens: torch.Tensor,
                     block_table: torch.Tensor, scale: float, window: int = 0, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None, *,
                     alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, Dqk] -> [B, H, Dv]: query b (at position cache_lens[b] - 1) over its keys
    max(0, cache_lens[b] - window) .. cache_lens[b] - 1 (window 0: all). k_scale / v_scale: the scales of
    8-bit pages (None: pages in q's dtype); sinks [H] fp32 or None; alibi_slopes [H]: ALiBi bias
    slope * (key - position) as a float mask (eager only: models with ALiBi do not compile)."""
    if alibi_slopes is not None:
        return _decode_attention(q, k_pages, v_pages, cache_lens, block_table, scale, window, k_scale, v_scale,
                                 sinks, alibi_slopes)
    if torch.compiler.is_compiling():  # an opaque op in the compiled graph (see _decode_attention_op)
        return torch.ops.tritonq.cpu_decode_attention(q, k_pages, v_pages, cache_lens, block_table, scale, window,
                                                      k_scale, v_scale, sinks)
    return _decode_attention(q, k_pages, v_pages, cache_lens, block_table, scale, window, k_scale, v_scale, sinks)


def _decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, cache_lens: torch.Tensor,
                      block_table: torch.Tensor, scale: float, window: int, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    if alibi_slopes is None and sinks is None and k_scale is None:  # the C kernel, where it takes the call
        out = cpu_native.decode_attention(q, k_pages, v_pages, cache_lens, block_table, scale, window)
        if out is not None:
            return out
    B, H, _ = q.shape
    H_kv = k_pages.shape[2]
    out = q.new_zeros(B, H, v_pages.shape[-1])
    grouped = q.view(B, H_kv, H // H_kv, -1)  # a kv head's query heads as its query rows
    grouped_sinks = None if sinks is None else sinks.view(H_kv, H // H_kv)  # one per query row
    lens = cache_lens.tolist()
    firsts = [max(0, n - window) if window else 0 for n in lens]
    grouped_step = (alibi_slopes is None and sinks is None and torch.get_num_threads() > 1
                    and H * (sum(lens) - sum(firsts)) >= GROUPED_WORK)
    plan = key_plan(firsts, lens, block_table, k_pages.shape[1], GROUP_KEYS if grouped_step else 0)
    k_rows, v_rows = _page_rows(k_pages, k_scale), _page_rows(v_pages, v_scale)
    with threads_for(PARALLEL_WORK if grouped_step else H * max(lens, default=0), PARALLEL_WORK):
        for group in plan.groups:  # sequences without keys are in none: zeros
            k, v = (_gather(rows, group.slots, q.dtype) for rows in (k_rows, v_rows))
            if group.index is not None:  # [G, Hkv, L, D] padded keys, the padding masked
                G, L = len(group.rows), group.length
                k, v = (x.unflatten(1, (G, L)).transpose(0, 1) for x in (k, v))
                rows = _sdpa(grouped.index_select(0, group.index), k, v, scale, group.mask)
                out.index_copy_(0, group.index, rows.reshape(G, H, -1))
                continue
            b = group.rows[0]
            if alibi_slopes is None:
                out[b] = _sdpa(grouped[b], k, v, scale, sinks=grouped_sinks).reshape(H, -1)
                continue
            # ALiBi: bias [Hkv, group, keys]; in fp32 throughout (SDPA wants the mask in q's dtype, and a bf16
            # bias of -slope * distance would be off by up to 2^-9 of it)
            keys = torch.arange(firsts[b] - (lens[b] - 1), 1, device=q.device, dtype=torch.float32)
            bias = alibi_slopes.view(H_kv, -1, 1) * keys
            out[b] = _sdpa(grouped[b].float(), k.float(), v.float(), scale, bias).reshape(H, -1).to(q.dtype)
    return out


def paged_prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor,
                            scale: float, window: int = 0, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None, *,
                            alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, Dqk] packed -> [T, H, Dv]: sequence b's rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1
    at positions ctx - n_q .. ctx - 1 (ctx = context_lens[b]), causal over keys 0 .. ctx - 1. k_scale /
    v_scale: the scales of 8-bit pages (None: pages in q's dtype); sinks [H] fp32 or None.
    alibi_slopes [H]: ALiBi, a float mask slope * (key - position) with -inf above the diagonal."""
    if alibi_slopes is None and sinks is None and k_scale is None:  # the C kernel, where it takes the call
        out = cpu_native.paged_attention(q, k_pages, v_pages, cu_seqlens_q, context_lens, block_table, scale, window)
        if out is not None:
            return out
    head_sinks = None if sinks is None else sinks[:, None]  # [H, 1]: one per query row of a head
    out = q.new_empty(q.shape[0], q.shape[1], v_pages.shape[-1])
    cu, contexts = cu_seqlens_q.tolist(), context_lens.tolist()
    n_qs = [b - a for a, b in zip(cu, cu[1:])]
    largest = max((n_q * ctx for n_q, ctx in zip(n_qs, contexts)), default=0)
    wins = [window if 0 < window < ctx else 0 for ctx in contexts]  # a window as long as the context hides nothing
    plan = key_plan([max(0, ctx - n_q - win + 1) if win else 0 for n_q, ctx, win in zip(n_qs, contexts, wins)],
                    [ctx if n_q else 0 for n_q, ctx in zip(n_qs, contexts)], block_table, k_pages.shape[1])
    k_rows, v_rows = _page_rows(k_pages, k_scale), _page_rows(v_pages, v_scale)
    with threads_for(q.shape[1] * largest, PARALLEL_WORK):
        for group in plan.groups:  # one sequence each (rows without queries are in none)
            b = group.rows[0]
            n_q, ctx, win, first = n_qs[b], contexts[b], wins[b], plan.first[b]
            k, v = (_gather(rows, group.slots, q.dtype) for rows in (k_rows, v_rows))
            mask = None
            if win or n_q != ctx or alibi_slopes is not None:  # not plain causal attention: mask by position
                pos = torch.arange(ctx - n_q, ctx, device=q.device)[:, None]
                key = torch.arange(first, ctx, device=q.device)[None, :]
                mask = (key <= pos) & (pos - key < win) if win else key <= pos
            queries = q[cu[b]:cu[b + 1]].transpose(0, 1)
            if alibi_slopes is not None:  # [H, n_q, keys] fp32 bias, -inf where not visible; fp32 as in decode
                mask = (alibi_slopes[:, None, None] * (key - pos).float()).masked_fill(~mask, float("-inf"))
                queries, k, v = queries.float(), k.float(), v.float()
            rows = _sdpa(queries, k, v, scale, mask, causal=mask is None, sinks=head_sinks).to(q.dtype)
            out[cu[b]:cu[b + 1]] = rows.transpose(0, 1)
    return out


def write_kv_slots(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> None:
    """Token t's k [T, Hkv, Dqk] / v [T, Hkv, Dv] into row slot_mapping[t] of the pages seen as rows,
    in place; tokens with slot < 0 are skipped. k_scale / v_scale: 8-bit pages' scales (int8: written too)."""
    if torch.compiler.is_compiling():  # an opaque op in the compiled graph (see _write_kv_slots_op)
        return torch.ops.tritonq.cpu_write_kv_slots(k_pages, v_pages, k, v, slot_mapping, k_scale, v_scale)
    _write_kv_slots(k_pages, v_pages, k, v, slot_mapping, k_scale, v_scale)


def _write_kv_slots(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    if k_scale is None and cpu_native.write_kv(k_pages, v_pages, k, v, slot_mapping):  # one C loop where built
        return
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    writes = [(k_pages, k), (v_pages, v)]
    if k_scale is not None:
        k, v, k_rows, v_rows = quantize_kv(k, v, k_pages.dtype, k_scale, v_scale)
        writes = [(k_pages.view(torch.uint8), k.view(torch.uint8)), (v_pages.view(torch.uint8), v.view(torch.uint8))]
        if k_rows is not None:  # int8: the rows' scales beside them
            writes += [(k_scale, k_rows), (v_scale, v_rows)]
    for pages, new in writes:
        pages.view(-1, *pages.shape[2:]).index_copy_(0, slot_mapping, new)  # view: raises rather than copy


INT8_MAX, FP8_MAX, SCALE_EPS = 127.0, 448.0, 1e-10  # as kernels/attention/pages.py's KV_INT8_MAX, KV_FP8_MAX, KV_SCALE_EPS


def quantize_kv(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype, k_scale: torch.Tensor,
                v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """k [T, Hkv, Dqk], v [T, Hkv, Dv] -> (k codes, v codes) in dtype (int8 / float8_e4m3fn) and, for int8,
    the rows' scales [T, Hkv] (fp32 absmax / 127; one for k and v when k_scale and v_scale are one tensor,
    MLA's latent); fp8 divides by the per-tensor scales and saturates at +-448."""
    if dtype == torch.float8_e4m3fn:
        return (*((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(dtype) for x, s in ((k, k_scale), (v, v_scale))),
                None, None)
    k_absmax, v_absmax = k.float().abs().amax(-1), v.float().abs().amax(-1)
    if k_scale.data_ptr() == v_scale.data_ptr():
        k_absmax = v_absmax = torch.maximum(k_absmax, v_absmax)
    k_rows, v_rows = (absmax.clamp(min=SCALE_EPS) / INT8_MAX for absmax in (k_absmax, v_absmax))
    return (*(torch.floor(x.float() / s[..., None] + 0.5).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
              for x, s in ((k, k_rows), (v, v_rows))), k_rows, v_rows)


@dataclass(frozen=True)
class KeyGroup:
    """Sequences attended in one flash call. rows: their batch rows; slots int64: where their keys lie in the pages
    seen as rows [P * page_size, Hkv, D] (page * page_size + row). One sequence: its keys in order, index and
    mask None. Several: each padded to `length` keys (the padding repeats its last key, so never reads a row
    outside its keys), slots [G * length], index their rows as a tensor [G], mask [G, 1, 1, length] bool (None
    when none is padded)."""
    rows: list[int]
    slots: torch.Tensor
    length: int
    index: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class KeyPlan:
    """The groups over the sequences with keys (keys first[b] .. last[b] - 1 of sequence b), and first."""
    first: list[int]
    groups: list[KeyGroup]


PLAN_CACHE_SIZE = 8  # plans kept: a step's (at most a few windows: layers alternating sliding and full attention)
_plans: dict[tuple, tuple[bytes, KeyPlan]] = {}


def key_plan(first: list[int], last: list[int], block_table: torch.Tensor, page_size: int,
             group_keys: int = 0) -> KeyPlan:
    """The KeyPlan of keys first[b] .. last[b] - 1 of each sequence b (block_table [B, max_pages] int32 on the
    CPU). group_keys 0: one group per sequence, in batch order; else sequences of similar key counts (longest
    first) share a group while its padded keys stay within group_keys and PADDING_SLACK x its real keys.
    Every layer of a step asks for the same plan: it is computed once, in numpy over the whole batch, and
    returned from a cache keyed by the values it depends on (lengths, page size, grouping, the table's bytes)."""
    key = (page_size, group_keys, tuple(first), tuple(last))
    table = block_table.numpy()
    table_bytes = table.tobytes()
    hit = _plans.get(key)
    if hit is not None and hit[0] == table_bytes:
        return hit[1]
    starts_at = np.asarray(first, dtype=np.int64)
    counts = np.maximum(np.asarray(last, dtype=np.int64) - starts_at, 0)
    offsets = np.cumsum(counts) - counts  # where each sequence's slots begin in the flat array
    owner = np.repeat(np.arange(len(counts)), counts)
    positions = np.arange(int(counts.sum())) + (starts_at - offsets)[owner]
    flat = table[owner, positions // page_size].astype(np.int64) * page_size + positions % page_size
    sizes, starts = counts.tolist(), offsets.tolist()
    if not group_keys:
        slots = torch.from_numpy(flat)
        groups = [KeyGroup([b], slots[o:o + c], c) for b, (o, c) in enumerate(zip(starts, sizes)) if c]
    else:
        groups = []
        order = sorted((b for b, c in enumerate(sizes) if c), key=sizes.__getitem__, reverse=True)
        i = 0
        while i < len(order):
            length = real = sizes[order[i]]
            j = i + 1
            while (j < len(order) and (j - i + 1) * length <= group_keys
                   and (j - i + 1) * length <= PADDING_SLACK * (real + sizes[order[j]])):
                real += sizes[order[j]]
                j += 1
            rows = order[i:j]
            if len(rows) == 1:
                groups.append(KeyGroup(rows, torch.from_numpy(flat[starts[rows[0]]:starts[rows[0]] + length]), length))
            else:
                keys = np.arange(length)[None, :]
                held = counts[rows][:, None]
                index = offsets[rows][:, None] + np.minimum(keys, held - 1)
                mask = None if real == len(rows) * length else torch.from_numpy(keys < held)[:, None, None, :]
                groups.append(KeyGroup(rows, torch.from_numpy(flat[index].reshape(-1)), length,
                                       torch.tensor(rows, dtype=torch.int64), mask))
            i = j
    plan = KeyPlan(list(first), groups)
    if len(_plans) >= PLAN_CACHE_SIZE:
        _plans.clear()
    _plans[key] = (table_bytes, plan)
    return plan


def _page_rows(pages: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(pages [P, page_size, Hkv, D] as rows [P * page_size, Hkv, D], int8 scales [P, page_size, Hkv] as rows
    [P * page_size, Hkv, 1] / fp8's per-tensor scale / None); views, no copy."""
    if scale is not None and scale.dim():
        scale = scale.flatten(0, 1)[..., None]
    return pages.flatten(0, 1), scale


def _gather(rows: tuple[torch.Tensor, torch.Tensor | None], slots: torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """The page rows at slots, [Hkv, n, D] (a strided view of one copy); 8-bit rows (a scale in rows, from
    _page_rows) dequantized to dtype."""
    pages, scale = rows
    held = pages.index_select(0, slots)
    if scale is not None:
        if scale.dim():  # int8: each row's scale, gathered alike
            scale = scale.index_select(0, slots)
        held = (held.float() * scale).to(dtype)
    return held.transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None,
          causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention on [heads, rows, D] (GQA through enable_gqa) as one batch of the CPU
    flash kernel, or on [batch, heads, rows, D] (mask [batch, 1, 1, keys]) as that batch; Dqk != Dv zero-padded
    to one head dim so that it takes them; returns [H, rows, Dv] (or [batch, H, rows, Dv]).
    sinks [H, rows] or [H, 1] fp32: each row's output scaled by sigmoid(lse - sink) (module docstring)."""
    single = q.dim() == 3  # 4-D inputs only: 3-D ones run the unfused math path
    if single:
        q, k, v = q[None], k[None], v[None]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_v < d_qk:
        v = F.pad(v, (0, d_qk - d_v))
    elif d_qk < d_v:
        q, k = F.pad(q, (0, d_v - d_qk)), F.pad(k, (0, d_v - d_qk))
    if sinks is not None:  # the flash kernel itself (GQA indexed natively), for its log-sum-exp [batch, H, rows]
        if mask is not None:  # the op takes an additive mask (F.sdpa converts a boolean one the same way)
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
        keep = torch.sigmoid(lse.float() - sinks)  # e^lse / (e^lse + e^sink), in fp32
        out = (out[..., :d_v].float() * keep[..., None]).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])[..., :d_v]
    return out[0] if single else out



# torch.compile (tritonq.engine.compiled) sees decode attention and the KV write as two opaque ops: their
# loops over sequences read lengths and slots on the host, which dynamo cannot trace without breaking the
# graph in every layer. Registered through torch.library.Library (~5 us a call; torch.library.custom_op's
# Python wrapper measured ~25 us, a real share of a small model's step); eager calls skip even that.
_ops = torch.library.Library("tritonq", "FRAGMENT")
_ops.define("cpu_decode_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor cache_lens, Tensor block_table, "
            "float scale, int window, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? sinks=None) -> Tensor")
_ops.impl("cpu_decode_attention", _decode_attention, "CPU")
_ops.impl("cpu_decode_attention", lambda q, k_pages, v_pages, cache_lens, block_table, scale, window, k_scale=None,
          v_scale=None, sinks=None: q.new_empty(q.shape[0], q.shape[1], v_pages.shape[-1]), "Meta")
_ops.define("cpu_write_kv_slots(Tensor(a!) k_pages, Tensor(b!) v_pages, Tensor k, Tensor v, Tensor slot_mapping, "
            "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> ()")
_ops.impl("cpu_write_kv_slots", _write_kv_slots, "CPU")
_ops.impl("cpu_write_kv_slots", lambda k_pages, v_pages, k, v, slot_mapping, k_scale=None, v_scale=None: None, "Meta")
