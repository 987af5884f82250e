"""Torch references of the attention kernels (float32 compute): the test oracle and TRITONQ_BACKEND=torch."""
from __future__ import annotations

import torch

from tritonq.kernels.attention.pages import (KV_FP8_MAX, KV_INT8_MAX, KV_SCALE_EPS, QuantizedPages,
                                           dequantize_pages, shares_scale)

def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Pages [P, page_size, Hkv, D] -> per-sequence [B, max_pages * page_size, Hkv, D] (a copy)."""
    pages = cache[block_table.long().clamp(0, cache.shape[0] - 1)]  # entries past a sequence are never read
    return pages.flatten(1, 2)


def decode_attention_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                               cache_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                               window: int = 0, sinks: torch.Tensor | None = None, *,
                               alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, float32: each sequence's pages gathered into rows, softmax over its positions
    < cache_lens[b] (and, if window > 0, >= cache_lens[b] - window); sinks [H]: one more logit per head
    in the softmax, whose probability is dropped (transformers' gpt-oss eager attention).

    Query heads are grouped by kv head ([B, Hkv, group, Dqk] @ [B, Hkv, Dqk, Smax]), so GQA copies
    no cache rows. QuantizedPages are dequantized to float32 first.
    """
    k_cache, v_cache = (gather_pages(dequantize_pages(pages), block_table) for pages in (k_pages, v_pages))
    B, H, _ = q.shape
    S_max, H_kv = k_cache.shape[1], k_cache.shape[2]
    scores = q.float().reshape(B, H_kv, H // H_kv, -1) @ k_cache.float().permute(0, 2, 3, 1) * scale
    # scores [B, Hkv, group, Smax]: hide positions past each length (always: whether any sequence is
    # shorter than Smax is a device value, and reading it on the host would sync every layer)
    pos = torch.arange(S_max, device=q.device)
    pad = pos >= cache_lens[:, None]
    if window:
        pad = pad | (pos < cache_lens[:, None] - window)
    if alibi_slopes is not None:  # slope[h] * (key - query position), the query at cache_lens - 1
        offset = (pos[None, :] - (cache_lens[:, None] - 1)).float()  # [B, Smax]
        scores = scores + alibi_slopes.float().view(1, H_kv, H // H_kv, 1) * offset[:, None, None, :]
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = _softmax_with_sinks(scores, None if sinks is None else sinks.view(H_kv, H // H_kv, 1))
    out = probs @ v_cache.float().transpose(1, 2)  # [B, Hkv, group, Dv]
    # A sequence with no keys (a padding row, context length 0) gets zeros, as the kernel gives, not NaN.
    out = torch.where(cache_lens[:, None, None, None] > 0, out, 0.0)
    return out.reshape(B, H, -1).to(q.dtype)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim; with sinks (broadcast to scores[..., :1]) a sink column joins the
    softmax and is then dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink_column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]


def quantize_kv_reference(k_pages: QuantizedPages, v_pages: QuantizedPages, k: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Plain torch: k [T, Hkv, Dqk], v [T, Hkv, Dv] -> (k codes, v codes) in the pages' dtype and, for int8,
    their scales [T, Hkv] (None for fp8's per-tensor scales), as the module docstring defines them."""
    if k_pages.data.dtype == torch.float8_e4m3fn:
        return (*((x.float() / pages.scale).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(torch.float8_e4m3fn)
                  for x, pages in ((k, k_pages), (v, v_pages))), None, None)
    k_absmax, v_absmax = k.float().abs().amax(-1), v.float().abs().amax(-1)
    if shares_scale(k_pages, v_pages):
        k_absmax = v_absmax = torch.maximum(k_absmax, v_absmax)
    scales = [absmax.clamp(min=KV_SCALE_EPS) / KV_INT8_MAX for absmax in (k_absmax, v_absmax)]
    codes = [torch.floor(x.float() / s[..., None] + 0.5).clamp(-KV_INT8_MAX, KV_INT8_MAX).to(torch.int8)
             for x, s in zip((k, v), scales)]
    return codes[0], codes[1], scales[0], scales[1]


def write_kv_slots_reference(k_pages: torch.Tensor | QuantizedPages, v_pages: torch.Tensor | QuantizedPages,
                             k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """index_put: token t to page slot_mapping[t] // block_size, row slot_mapping[t] % block_size;
    negative slots (padding) are skipped.

    Shape-static, with no host read (TRITONQ_BACKEND=torch runs it on any device): rather than selecting
    the kept rows (a data-dependent shape), every skipped row is redirected to the slot of the first kept
    row with that row's own values, so the duplicate writes agree; with no kept row at all they all
    write slot 0's current values back. QuantizedPages get `quantize_kv_reference`'s codes (fp8 as its
    bytes) and, for int8, its scales at the same [page, row]."""
    keep = slot_mapping >= 0
    first = keep.to(torch.int8).argmax(0, keepdim=True)  # [1]: the first kept row (0 when there is none)
    target = torch.where(keep, slot_mapping, slot_mapping[first].clamp(min=0)).long()
    page, row = target // k_pages.shape[1], target % k_pages.shape[1]
    writes = [(k_pages, k), (v_pages, v)]
    if isinstance(k_pages, QuantizedPages):
        k_codes, v_codes, k_scales, v_scales = quantize_kv_reference(k_pages, v_pages, k, v)
        writes = [(k_pages.data.view(torch.uint8), k_codes.view(torch.uint8)),
                  (v_pages.data.view(torch.uint8), v_codes.view(torch.uint8))]
        if k_scales is not None:
            writes += [(k_pages.scale, k_scales), (v_pages.scale, v_scales)]
    for pages, new in writes:
        fill = torch.where(keep[first], new[first], pages[0, 0])  # what skipped rows write (to `target`)
        pages[page, row] = torch.where(keep.view(-1, *[1] * (new.dim() - 1)), new, fill)


def paged_prefill_attention_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                      block_table: torch.Tensor, scale: float, window: int = 0,
                                      sinks: torch.Tensor | None = None, *,
                                      alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, float32, one sequence at a time: gather its context_lens[b] keys from its pages,
    masked softmax with query i at position context_lens[b] - q_len + i (causal, optional window),
    sinks [H] as decode_attention_reference's. QuantizedPages are dequantized to float32 first."""
    k_pages, v_pages = dequantize_pages(k_pages), dequantize_pages(v_pages)
    H, group = q.shape[1], q.shape[1] // k_pages.shape[2]
    block_size = k_pages.shape[1]
    out = torch.zeros(q.shape[0], H, v_pages.shape[-1], dtype=torch.float32, device=q.device)
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    for b in range(len(ctx)):
        n_q, n_k = cu[b + 1] - cu[b], ctx[b]
        if n_q == 0:
            continue
        pages = block_table[b, :-(-n_k // block_size)].long()
        k = k_pages[pages].flatten(0, 1)[:n_k].float().repeat_interleave(group, dim=1)  # [n_k, H, Dqk]
        v = v_pages[pages].flatten(0, 1)[:n_k].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu[b]:cu[b + 1]].float(), k) * scale
        p = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        j = torch.arange(n_k, device=q.device)[None, :]
        visible = (j <= p) & ((p - j < window) if window else True)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float()[:, None, None] * (j - p).float()
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = _softmax_with_sinks(scores, None if sinks is None else sinks.view(H, 1, 1))
        out[cu[b]:cu[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------
