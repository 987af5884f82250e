"""Launchers: input checks, then paged prefill, decode (split + merge), and the KV write, each as a
`Launch` (for AOT fit checks) and as a call; CPU tensors take the CPU backend, TRITONQ_BACKEND=torch
the references."""
from __future__ import annotations

import torch
import triton

from tritonq.kernels import backend
from tritonq.kernels.cpu import attention as cpu_attention
from tritonq.kernels.attention.configs import (DecodeConfig, PrefillConfig, check_decode_config, check_prefill_config,
                                               head_blocks, launch_config, paged_block_n)
from tritonq.kernels.attention.jit import (_decode_merge_kernel, _decode_split_kernel, _paged_prefill_kernel,
                                           _write_slots_kernel)
from tritonq.kernels.attention.pages import LOG2E, QuantizedPages, shares_scale
from tritonq.kernels.attention.reference import (decode_attention_reference, paged_prefill_attention_reference,
                                                 write_kv_slots_reference)
from tritonq.kernels.common import Launch
from tritonq.kernels.norm_rope import apply_rope, rms_norm

def _check_lens(name: str, lens: torch.Tensor, batch: int, device: torch.device) -> None:
    if lens.dtype != torch.int32 or lens.shape != (batch,) or lens.device != device:
        raise ValueError(f"{name} must be an int32 tensor of shape [{batch}] on {device}; got "
                         f"{lens.dtype} {tuple(lens.shape)} on {lens.device}. "
                         f"Use torch.tensor(lengths, dtype=torch.int32, device=q.device).")


def _check_block_table(block_table: torch.Tensor, k_cache: torch.Tensor, batch: int, device: torch.device) -> int:
    """The page size of a paged cache (k_cache [P, page_size, Hkv, D]) after checking its block table."""
    page_size = k_cache.shape[1]
    if (not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or block_table.dim() != 2
            or block_table.shape[0] != batch or block_table.device != device):
        found = (f"{block_table.dtype} {tuple(block_table.shape)} on {block_table.device}"
                 if isinstance(block_table, torch.Tensor) else repr(block_table))
        raise ValueError(f"block_table must be an int32 tensor [{batch}, max_pages] on {device}; got {found}.")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"paged KV cache: page_size (k_cache.shape[1]) = {page_size}; expected a power of two "
                         ">= 16 (a key tile must fit in one page). vLLM's default is 16.")
    return page_size


def _check_slots(slot_mapping: torch.Tensor, capacity: int) -> None:
    """Every slot < capacity (num_blocks x block_size; < 0 skips): a ValueError on CPU (the values are on the
    host already: reading them syncs nothing), a device-side assert elsewhere (a host check would sync the
    GPU, and break graph capture)."""
    expected = f"write_kv_slots: slots must be < num_blocks x block_size = {capacity} (or < 0 to skip)"
    if slot_mapping.device.type != "cpu":
        torch._assert_async(slot_mapping.max() < capacity, expected)
    elif int(slot_mapping.max()) >= capacity:
        raise ValueError(f"{expected}; got {int(slot_mapping.max())}.")


def _check_prefill_lens(cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, T: int, capacity: int) -> None:
    """cu_seqlens_q rises from 0 to T and q_len_b <= context_lens[b] <= capacity (the block table's tokens):
    a ValueError on CPU (the values are on the host), a device-side assert on CUDA (a host check would sync)."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    consistent = ((cu_seqlens_q[0] == 0) & (cu_seqlens_q[-1] == T) & (q_lens >= 0).all()
                  & (context_lens >= q_lens).all() & (context_lens <= capacity).all())
    expected = (f"paged_prefill_attention: expected cu_seqlens_q rising from 0 to T = {T} and "
                f"q_len_b <= context_lens[b] <= block_table width x page_size = {capacity}")
    if cu_seqlens_q.device.type != "cpu":
        torch._assert_async(consistent, expected)
    elif not bool(consistent):
        raise ValueError(f"{expected}; got cu_seqlens_q {cu_seqlens_q.tolist()}, context_lens "
                         f"{context_lens.tolist()}. context_lens counts the cached prefix plus the new tokens.")


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str, quantized: bool = False) -> None:
    # 8-bit pages (checked by _unpack_pages) dequantize into q's dtype
    page_dtypes_ok = quantized or q.dtype == k.dtype == v.dtype
    if not page_dtypes_ok or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share one dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}. Cast them (or the KV cache) to the model dtype.")
    H, Hkv = q.shape[-2], k.shape[2]
    if k.shape[2] != v.shape[2] or H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads, and k and v must have the "
                         f"same kv heads; got k {tuple(k.shape)}, v {tuple(v.shape)} ({what}).")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: q {tuple(q.shape)}, k {tuple(k.shape)} ({what}).")


def _check_window(window) -> None:
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window = {window!r}; expected an int >= 0 (0: no sliding window).")


def _check_sinks(sinks, heads: int, device: torch.device) -> None:
    """sinks is None or a float32 [H] tensor on q's device (one logit per query head of this rank)."""
    if sinks is None:
        return
    if (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or sinks.shape != (heads,)
            or sinks.device != device):
        found = f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}" if isinstance(sinks, torch.Tensor) \
            else repr(sinks)
        raise ValueError(f"sinks must be a float32 tensor [{heads}] (one logit per query head) on {device}; got "
                         f"{found}. Convert once at load: sinks.float().contiguous().")


def _check_alibi(alibi_slopes: torch.Tensor | None, H: int, device: torch.device) -> None:
    if alibi_slopes is not None and (alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) != (H,)
                                     or alibi_slopes.device != device or not alibi_slopes.is_contiguous()):
        raise ValueError(f"alibi_slopes is {alibi_slopes.dtype} {tuple(alibi_slopes.shape)} on {alibi_slopes.device}; "
                         f"expected a contiguous float32 [{H}] (one slope per query head) on {device} "
                         "(tritonq.kernels.attention.alibi_slopes builds MPT's)")


def alibi_slopes(num_heads: int, bias_max: float = 8.0, device=None) -> torch.Tensor:
    """MPT's ALiBi slopes [num_heads] fp32: 2^(-bias_max * i / n) for i = 1..n, n = num_heads rounded up to a
    power of two; for other head counts the odd-indexed slopes of that list, then the even ones, cut to
    num_heads (MPT's rule, as transformers' build_mpt_alibi_tensor)."""
    n = 1 << max(0, num_heads - 1).bit_length()
    slopes = 1.0 / torch.pow(2.0, torch.arange(1, n + 1, dtype=torch.float32, device=device) * (bias_max / n))
    if n != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes.contiguous()


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _checked_pages(q: torch.Tensor, k_pages, v_pages, kernel: str, rows: str, what: str):
    """`_unpack_pages` of k_pages / v_pages after checking q [rows, H, Dqk] against them (ranks, page shapes,
    heads, dtypes); a ValueError naming kernel otherwise."""
    k_pages, v_pages, k_scale, v_scale = _unpack_pages(k_pages, v_pages, kernel)
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.dim() != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"{kernel}: expected q [{rows},H,Dqk], k_pages [P,page_size,Hkv,Dqk], v_pages "
                         f"[P,page_size,Hkv,Dv]; got q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}, "
                         f"v_pages {tuple(v_pages.shape)}.")
    _check_heads(q, k_pages, v_pages, what, k_scale is not None)
    return k_pages, v_pages, k_scale, v_scale


def _unpack_pages(k_pages, v_pages, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                        torch.Tensor | None]:
    """(k data, v data, k scale, v scale) of a checked pair of pages: plain tensors (scales None) or
    QuantizedPages (module docstring); a ValueError naming what is wrong otherwise."""
    quantized = isinstance(k_pages, QuantizedPages), isinstance(v_pages, QuantizedPages)
    if not any(quantized):
        return k_pages, v_pages, None, None
    if not all(quantized):
        raise ValueError(f"{what}: k_pages and v_pages must both be QuantizedPages or both plain tensors; got "
                         f"{type(k_pages).__name__} and {type(v_pages).__name__}.")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        data, scale = pages.data, pages.scale
        if data.dim() != 4 or data.dtype not in (torch.int8, torch.float8_e4m3fn) or data.stride(-1) != 1:
            raise ValueError(f"{what}: {name}.data must be int8 or float8_e4m3fn pages [P, page_size, Hkv, D], "
                             f"contiguous in D; got {data.dtype} {tuple(data.shape)} strides {data.stride()}.")
        expected = () if data.dtype == torch.float8_e4m3fn else tuple(data.shape[:3])
        if (scale.dtype != torch.float32 or tuple(scale.shape) != expected or scale.device != data.device
                or not scale.is_contiguous()):
            kind = "per tensor, []" if not expected else f"per token and kv head, {list(expected)} contiguous"
            raise ValueError(f"{what}: {name}.scale must be float32 ({kind}) on {data.device} for {data.dtype} "
                             f"pages; got {scale.dtype} {tuple(scale.shape)} on {scale.device}.")
    if k_pages.data.dtype != v_pages.data.dtype:
        raise ValueError(f"{what}: k and v pages differ in dtype ({k_pages.data.dtype}, {v_pages.data.dtype}); "
                         "one KV cache dtype per layer.")
    v = v_pages.data
    if v.shape[-1] % 2 or any(stride % 2 for stride in v.stride()[:-1]) or v.storage_offset() % 2:
        raise ValueError(f"{what}: 8-bit v pages are read as byte pairs (jit._attend_tile), so their head dim, "
                         f"strides and offset must be even; got Dv {v.shape[-1]}, strides {v.stride()}, offset "
                         f"{v.storage_offset()}. Pad the head dim to an even size.")
    return k_pages.data, v_pages.data, k_pages.scale, v_pages.scale


def _kv_launch_args(k_pages, v_pages) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The kernels' (k, v, quantization args) for plain or quantized pages: e4m3 pages travel as their bytes
    (uint8: the kernels decode them with integer ops on every GPU); no extra args for plain pages, so their
    launches are the same as before KV quantization existed."""
    if not isinstance(k_pages, QuantizedPages):
        return k_pages, v_pages, {}
    fp8 = k_pages.data.dtype == torch.float8_e4m3fn
    k, v = (p.data.view(torch.uint8) if fp8 else p.data for p in (k_pages, v_pages))
    return k, v, dict(k_scale_ptr=k_pages.scale, v_scale_ptr=v_pages.scale, KV_FP8=fp8, KV_INT8=not fp8)


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, cache_lens: torch.Tensor,
                     block_table: torch.Tensor, scale: float, window: int = 0, config: DecodeConfig | None = None,
                     max_seq_len: int | None = None, sinks: torch.Tensor | None = None, *,
                     alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged KV cache; see the module docstring.

    q [B, H, Dqk]; k_pages [P, page_size, Hkv, Dqk], v_pages [P, page_size, Hkv, Dv] (strided views
    allowed, e.g. MLA's v = k_pages[..., :512]); cache_lens [B] int32 counts each sequence's keys (the
    new token's included: write_kv_slots first); block_table [B, max_pages] int32: position n of
    sequence b is in page block_table[b, n // page_size]. Returns [B, H, Dv] in q's dtype.
    window > 0: sliding window, the query (at position cache_lens[b] - 1) sees the last `window` keys.
    config: launch config for the Triton kernels (the tuner's candidates; BLOCK_N <= page_size);
    None: `launch_config` (`decode_config`). The key tile is `paged_block_n`: BLOCK_N capped at page_size and at 32.
    max_seq_len: the capacity the launch config is chosen for (default: the block table width x
    page_size). The config never depends on cache_lens, so a growing sequence never recompiles and
    the launch is CUDA-graph safe. sinks [H] float32: attention sinks (see the module docstring).
    k_pages / v_pages may be QuantizedPages (8-bit, dequantized in registers).
    alibi_slopes [H] fp32: ALiBi (module docstring); None: none.
    """
    given = k_pages, v_pages
    k_pages, v_pages, k_scale, v_scale = _checked_pages(q, k_pages, v_pages, "decode_attention", "B", "decode")
    B, H, D_QK = q.shape
    _check_lens("cache_lens", cache_lens, B, q.device)
    page_size = _check_block_table(block_table, k_pages, B, q.device)
    if config is not None:
        check_decode_config(config, page_size)
    _check_window(window)
    _check_sinks(sinks, H, q.device)
    _check_alibi(alibi_slopes, H, q.device)
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
        raise ValueError(f"decode_attention: max_seq_len = {max_seq_len!r}; expected an int >= 1 (the capacity "
                         "the launch config is chosen for) or None.")
    b = backend(q)
    if b == "cpu":  # the C kernel, else torch's CPU flash attention over each sequence's real keys
        return cpu_attention.decode_attention(q, k_pages, v_pages, cache_lens, block_table, scale, window,
                                              k_scale, v_scale, sinks, alibi_slopes=alibi_slopes)
    if b == "torch":
        return decode_attention_reference(q, *given, cache_lens, block_table, scale, window, sinks,
                                          alibi_slopes=alibi_slopes)

    q = _last_dim_contiguous(q)
    if k_scale is None:
        k_pages, v_pages = map(_last_dim_contiguous, (k_pages, v_pages))
    else:  # 8-bit pages (contiguous in the head dim: _unpack_pages) travel with their scales
        k_pages, v_pages = given
    cfg = config or launch_config(DecodeConfig, q, k_pages, v_pages, block_table, window, max_seq_len)
    split, merge, out = decode_launches(q, k_pages, v_pages, cache_lens, block_table, scale, window, cfg, sinks,
                                        alibi_slopes=alibi_slopes)
    split()
    if merge is not None:
        merge()
    return out


def decode_launches(q: torch.Tensor, k_pages: torch.Tensor | QuantizedPages, v_pages: torch.Tensor | QuantizedPages,
                    cache_lens: torch.Tensor, block_table: torch.Tensor, scale: float, window: int,
                    cfg: DecodeConfig, sinks: torch.Tensor | None = None, *,
                    alibi_slopes: torch.Tensor | None = None) -> tuple[Launch, Launch, torch.Tensor]:
    """The launches of a decode step (_decode_split_kernel, then _decode_merge_kernel) for checked inputs of
    decode_attention (head dim contiguous), and the output o [B, H, Dv]; with one split (cfg.NUM_SPLITS == 1:
    batch x kv heads fill the GPU already) the split kernel writes o itself and merge is None. Over meta
    tensors they are what tune --aot and the AOT tests compile. sinks [H] fp32 enter the merge (or the one split)."""
    k_pages, v_pages, kv_args = _kv_launch_args(k_pages, v_pages)
    B, H, D_QK = q.shape
    H_kv, D_V = k_pages.shape[2], v_pages.shape[-1]
    group = H // H_kv
    block_d, block_dr, block_dv = head_blocks(D_QK, D_V)
    block_h = min(64, max(16, triton.next_power_of_2(group)))  # tl.dot needs >= 16 rows
    page_size = k_pages.shape[1]
    block_n = paged_block_n(cfg.BLOCK_N, page_size)  # a key tile within one page, <= 32 keys
    out = torch.empty(B, H, D_V, dtype=q.dtype, device=q.device)
    direct = cfg.NUM_SPLITS == 1
    if direct:  # no partial results: the part pointers are placeholders the kernel does not touch
        part_o = part_lse = out
    else:
        part_o = torch.empty(B, H, cfg.NUM_SPLITS, D_V, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, H, cfg.NUM_SPLITS, dtype=torch.float32, device=q.device)
    split = dict(q_ptr=q, k_ptr=k_pages, v_ptr=v_pages, cache_lens_ptr=cache_lens, block_table_ptr=block_table,
                 part_o_ptr=part_o, part_lse_ptr=part_lse, stride_qb=q.stride(0), stride_qh=q.stride(1),
                 stride_kp=k_pages.stride(0), stride_ks=k_pages.stride(1), stride_kh=k_pages.stride(2),
                 stride_vp=v_pages.stride(0), stride_vs=v_pages.stride(1), stride_vh=v_pages.stride(2),
                 stride_bt=block_table.stride(0), H=H, D_QK=D_QK, D_V=D_V, qk_scale=scale * LOG2E, window=window,
                 GROUP=group, NUM_SPLITS=cfg.NUM_SPLITS, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
                 BLOCK_DR=block_dr, BLOCK_DV=block_dv, PAGE_SIZE=page_size, HAS_WINDOW=window > 0, **kv_args,
                 alibi_ptr=q if alibi_slopes is None else alibi_slopes * LOG2E, HAS_ALIBI=alibi_slopes is not None)
    if direct:
        split.update(o_ptr=out, stride_ob=out.stride(0), stride_oh=out.stride(1), sinks_ptr=sinks,
                     HAS_SINKS=sinks is not None)
    split_launch = Launch(_decode_split_kernel, (B, H_kv * triton.cdiv(group, block_h), cfg.NUM_SPLITS), split,
                          cfg.num_warps, cfg.num_stages)
    if direct:
        return split_launch, None, out
    block_splits = triton.next_power_of_2(cfg.NUM_SPLITS)
    merge = dict(part_o_ptr=part_o, part_lse_ptr=part_lse, o_ptr=out, stride_ob=out.stride(0),
                 stride_oh=out.stride(1), H=H, D_V=D_V, NUM_SPLITS=cfg.NUM_SPLITS, BLOCK_SPLITS=block_splits,
                 BLOCK_DV=block_dv, sinks_ptr=part_lse if sinks is None else sinks, HAS_SINKS=sinks is not None)
    # The merge holds all partial outputs [BLOCK_SPLITS, BLOCK_DV] fp32 at once: a warp per 4096 of them
    # keeps it at <= 128 per thread (MLA's 64 x 512 spills 5.4 KB with 4 warps on sm_90, none with 8: AOT).
    merge_warps = min(16, max(4, block_splits * block_dv // 4096))
    merge_launch = Launch(_decode_merge_kernel, (B, H), merge, merge_warps, 1)  # one pass: nothing to pipeline
    return split_launch, merge_launch, out


def write_kv_slots(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor, *, check_values: bool = True) -> None:
    """Scatter one step's new tokens into a paged cache, in place.

    k_pages [num_blocks, block_size, Hkv, Dqk], v_pages [num_blocks, block_size, Hkv, Dv] (v_pages
    may be a strided view, e.g. the MLA latent k_pages[..., :512]); k [T, Hkv, Dqk], v [T, Hkv, Dv];
    slot_mapping [T] int64: token t goes to page slot // block_size, row slot % block_size; a
    slot < 0 is skipped (padding, e.g. unused rows of a CUDA-graph bucket).
    check_values=False skips the check of the slots' values (a device reduction and assert on CUDA):
    for callers that checked them already, e.g. models, whose steps the engine's runner checks once
    on the host (every layer would otherwise repeat it). Shapes, dtypes and devices are always checked.
    QuantizedPages: k and v (in the model dtype) are quantized as they are written (module docstring).
    """
    given = k_pages, v_pages
    k_pages, v_pages, k_scale, v_scale = _checked_write(k_pages, v_pages, k, v, slot_mapping, check_values)
    if k.shape[0] == 0:
        return
    b = backend(k_pages)
    if b == "cpu":  # the C loop, else one index_copy_ per cache (kernels/cpu/attention.py)
        return cpu_attention.write_kv_slots(k_pages, v_pages, k, v, slot_mapping, k_scale, v_scale)
    if b == "torch":
        return write_kv_slots_reference(*given, k, v, slot_mapping)
    write_kv_slots_launch(*given, _last_dim_contiguous(k), _last_dim_contiguous(v), slot_mapping)[0]()


def _checked_write(k_pages, v_pages, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                   check_values: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """write_kv_slots' checks (a ValueError naming what is wrong); returns `_unpack_pages` of the pages."""
    k_pages, v_pages, k_scale, v_scale = _unpack_pages(k_pages, v_pages, "write_kv_slots")
    if (k.dim() != 3 or v.dim() != 3 or k_pages.dim() != 4 or v_pages.dim() != 4 or k.shape[:2] != v.shape[:2]
            or k_pages.shape[:3] != v_pages.shape[:3] or k_pages.shape[2:] != k.shape[1:]
            or v_pages.shape[2:] != v.shape[1:]):
        raise ValueError(f"write_kv_slots: expected k [T,Hkv,Dqk], v [T,Hkv,Dv] matching k_pages "
                         f"[num_blocks,block_size,Hkv,Dqk], v_pages [num_blocks,block_size,Hkv,Dv]; got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, k_pages {tuple(k_pages.shape)}, "
                         f"v_pages {tuple(v_pages.shape)}.")
    if k_scale is not None:
        if k.dtype != v.dtype or k.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"write_kv_slots: k/v dtypes {k.dtype}/{v.dtype}; 8-bit pages take fp16/bf16/fp32 "
                             "k and v of one dtype (the model's), quantized as they are written.")
    elif k.dtype != k_pages.dtype or v.dtype != v_pages.dtype:
        raise ValueError(f"write_kv_slots: k/v dtypes {k.dtype}/{v.dtype} differ from the cache's "
                         f"{k_pages.dtype}/{v_pages.dtype}; cast k and v to the cache dtype first.")
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("write_kv_slots: k_pages and v_pages must be contiguous in the head dim (written in place).")
    T = k.shape[0]
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (T,) or slot_mapping.device != k.device:
        raise ValueError(f"write_kv_slots: slot_mapping must be an int64 tensor of shape [{T}] on {k.device}; "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)} on {slot_mapping.device}.")
    if check_values and T:
        _check_slots(slot_mapping, k_pages.shape[0] * k_pages.shape[1])
    return k_pages, v_pages, k_scale, v_scale


def write_kv_slots_launch(k_pages: torch.Tensor | QuantizedPages, v_pages: torch.Tensor | QuantizedPages,
                          k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, q: torch.Tensor | None = None,
                          cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                          q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                          eps: float = 0.0) -> tuple[Launch, torch.Tensor | None]:
    """The launch of _write_slots_kernel for checked inputs of write_kv_slots (k, v head dim contiguous): one
    program per (token, kv head); and with q [T, H, Dqk] (rope_write_kv_slots' checked inputs), one more per
    (token, query head) rotating q into the returned q_out [T, H, Dqk] (None without q). Over meta tensors it
    is what the AOT tests compile."""
    shared = isinstance(k_pages, QuantizedPages) and shares_scale(k_pages, v_pages)
    k_pages, v_pages, kv_args = _kv_launch_args(k_pages, v_pages)
    if shared:
        kv_args["SHARED_SCALE"] = True
    args = dict(k_pages_ptr=k_pages, v_pages_ptr=v_pages, k_ptr=k, v_ptr=v, slot_ptr=slot_mapping,
                stride_kp=k_pages.stride(0), stride_ks=k_pages.stride(1), stride_kh=k_pages.stride(2),
                stride_vp=v_pages.stride(0), stride_vs=v_pages.stride(1), stride_vh=v_pages.stride(2),
                stride_kt=k.stride(0), stride_kth=k.stride(1), stride_vt=v.stride(0), stride_vth=v.stride(1),
                D_QK=k.shape[-1], D_V=v.shape[-1], BLOCK_D=triton.next_power_of_2(k.shape[-1]),
                BLOCK_DV=triton.next_power_of_2(v.shape[-1]), PAGE_SIZE=k_pages.shape[1], **kv_args)
    q_out, heads = None, k.shape[1]
    if q is not None:
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
        heads += q.shape[1]
        args.update(q_ptr=q, q_out_ptr=q_out, stride_qt=q.stride(0), stride_qth=q.stride(1),
                    stride_ot=q_out.stride(0), stride_oth=q_out.stride(1), H_Q=q.shape[1])
        if cos is not None:
            args.update(cos_ptr=cos, sin_ptr=sin, stride_cos=cos.stride(0), ROPE=True)
        if q_norm is not None:
            args.update(q_norm_ptr=q_norm, k_norm_ptr=k_norm, eps=eps, QK_NORM=True)
    return Launch(_write_slots_kernel, (k.shape[0], heads), args, 4, 3), q_out  # Triton's default warps, stages


def rope_write_kv_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        k_pages: torch.Tensor | QuantizedPages, v_pages: torch.Tensor | QuantizedPages,
                        slot_mapping: torch.Tensor, *, q_norm: torch.Tensor | None = None,
                        k_norm: torch.Tensor | None = None, eps: float = 0.0,
                        check_values: bool = True) -> torch.Tensor:
    """A rotary layer's step between its qkv linear and attention, in one launch on a GPU: rotate q [T, H, D]
    and k [T, Hkv, D] by cos / sin [T, D] (the table rows at the tokens' positions; norm_rope.apply_rope's
    rotate-half), write the rotated k and v [T, Hkv, Dv] into the pages as write_kv_slots does, and return
    the rotated q [T, H, D] in q's dtype. q_norm / k_norm [D] (both or neither): each head row is first
    RMS-normalized with that weight and eps (Qwen3's qk-norm). q, k, v may be strided views of one qkv
    output (head dim contiguous). Elsewhere than on a GPU: norm_rope's rms_norm and apply_rope, then
    write_kv_slots (the same values up to the rounding of the intermediate steps)."""
    T, D = k.shape[0], k.shape[-1]
    if q.dim() != 3 or q.shape[0] != T or q.shape[-1] != D or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(f"rope_write_kv_slots: expected q [T, H, D] like k [T, Hkv, D] ({k.dtype} on {k.device}); "
                         f"got q {q.dtype} {tuple(q.shape)} on {q.device}, k {tuple(k.shape)}.")
    if D % 2 or cos.shape != (T, D) or sin.shape != (T, D) or cos.device != q.device or sin.dtype != cos.dtype:
        raise ValueError(f"rope_write_kv_slots: expected an even head dim and cos / sin [T, D] = [{T}, {D}] of one "
                         f"dtype on {q.device} (the rope table rows at the tokens' positions); got D = {D}, cos "
                         f"{cos.dtype} {tuple(cos.shape)}, sin {sin.dtype} {tuple(sin.shape)} on {cos.device}.")
    if (q_norm is None) != (k_norm is None) or any(
            w is not None and (w.shape != (D,) or w.device != q.device) for w in (q_norm, k_norm)):
        raise ValueError(f"rope_write_kv_slots: q_norm and k_norm must both be [{D}] weights on {q.device}, or both "
                         "None (no qk-norm).")
    if backend(q) == "triton" and T > 0:
        _checked_write(k_pages, v_pages, k, v, slot_mapping, check_values)
        launch, q_out = write_kv_slots_launch(k_pages, v_pages, _last_dim_contiguous(k), _last_dim_contiguous(v),
                                              slot_mapping, _last_dim_contiguous(q), _last_dim_contiguous(cos),
                                              _last_dim_contiguous(sin), q_norm, k_norm, eps)
        launch()
        return q_out
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = (apply_rope(x[None], cos[None], sin[None])[0] for x in (q, k))
    write_kv_slots(k_pages, v_pages, k, v, slot_mapping, check_values=check_values)
    return q


def paged_prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor,
                            scale: float, window: int = 0, config: PrefillConfig | None = None, *,
                            check_values: bool = True, sinks: torch.Tensor | None = None,
                            alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over a paged cache that already holds them.

    q [T, H, Dqk]: sequence b's queries are rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 (varlen,
    packed), at positions context_lens[b] - q_len_b + i. k_pages [P, page_size, Hkv, Dqk], v_pages
    [P, page_size, Hkv, Dv] (strided views allowed, e.g. MLA's v = k_pages[..., :512]) hold each
    sequence's cached prefix and its new tokens (write_kv_slots first) at positions
    0 .. context_lens[b] - 1, position n in page block_table[b, n // page_size].
    cu_seqlens_q [B+1] int32, context_lens [B] int32, block_table [B, max_pages] int32.
    A query at position p sees keys j <= p and, if window > 0, p - j < window.
    Returns [T, H, Dv] in q's dtype. config: a PrefillConfig (key tiles may span pages); None:
    `launch_config` (`paged_prefill_config` for this GPU). check_values=False skips the check that cu_seqlens_q and
    context_lens agree with T and the block table (~8 small kernels and an assert on CUDA, a host read on
    CPU): for callers that checked them already (models: the engine's runner checks each step once).
    sinks [H] float32: attention sinks (see the module docstring).
    k_pages / v_pages may be QuantizedPages (8-bit, dequantized in registers).
    alibi_slopes [H] fp32: ALiBi (module docstring); None: none.
    """
    given = k_pages, v_pages
    k_pages, v_pages, k_scale, v_scale = _checked_pages(q, k_pages, v_pages, "paged_prefill_attention", "T",
                                                        "paged prefill")
    _check_window(window)
    _check_sinks(sinks, q.shape[1], q.device)
    _check_alibi(alibi_slopes, q.shape[1], q.device)
    B = context_lens.shape[0] if context_lens.dim() == 1 else -1
    _check_lens("context_lens", context_lens, B, q.device)
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (B + 1,) or cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q must be an int32 tensor of shape [{B + 1}] on {q.device} (cumulative "
                         f"query counts, starting at 0); got {cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)} "
                         f"on {cu_seqlens_q.device}.")
    page_size = _check_block_table(block_table, k_pages, B, q.device)
    if config is not None:
        check_prefill_config(config)
    if check_values:
        _check_prefill_lens(cu_seqlens_q, context_lens, q.shape[0], block_table.shape[1] * page_size)
    b = backend(q)
    if b == "cpu":  # kernels/cpu/attention.py
        return cpu_attention.paged_prefill_attention(q, k_pages, v_pages, cu_seqlens_q, context_lens, block_table,
                                                     scale, window, k_scale, v_scale, sinks, alibi_slopes=alibi_slopes)
    if b == "torch":
        return paged_prefill_attention_reference(q, *given, cu_seqlens_q, context_lens, block_table, scale, window,
                                                 sinks, alibi_slopes=alibi_slopes)

    T, D_V = q.shape[0], v_pages.shape[-1]
    config = config or launch_config(PrefillConfig, q, k_pages, v_pages, block_table)
    if T == 0 or B == 0:
        return torch.empty(T, q.shape[1], D_V, dtype=q.dtype, device=q.device)
    launch, out = paged_prefill_launch(_last_dim_contiguous(q), *given, cu_seqlens_q, context_lens,
                                       block_table, scale, window, config, sinks, alibi_slopes=alibi_slopes)
    launch()
    return out


def paged_prefill_launch(q: torch.Tensor, k_pages: torch.Tensor | QuantizedPages,
                         v_pages: torch.Tensor | QuantizedPages, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, scale: float, window: int,
                         cfg: PrefillConfig, sinks: torch.Tensor | None = None, *,
                         alibi_slopes: torch.Tensor | None = None) -> tuple[Launch, torch.Tensor]:
    """The launch of _paged_prefill_kernel for checked inputs of paged_prefill_attention (q head dim
    contiguous, T and B > 0) and its output [T, H, Dv]. Over meta tensors it is what the AOT tests compile.

    Query blocks of all sequences are numbered in order: sum_b ceil(q_len_b / BLOCK_M) <= T / BLOCK_M + B,
    so a grid of that upper bound needs no host read of the lengths; a `work` table [2, programs] int32
    gives each program its (sequence, first query row), sequence -1 for the spare ones.
    """
    k_pages, v_pages, kv_args = _kv_launch_args(k_pages, v_pages)
    T, H, D_QK = q.shape
    B, D_V = context_lens.shape[0], v_pages.shape[-1]
    block_d, block_dr, block_dv = head_blocks(D_QK, D_V)
    num_work = triton.cdiv(T, cfg.BLOCK_M) + B
    blocks = (cu_seqlens_q[1:] - cu_seqlens_q[:-1] + cfg.BLOCK_M - 1) // cfg.BLOCK_M
    ends = torch.cumsum(blocks, 0)
    program = torch.arange(num_work, device=q.device, dtype=ends.dtype)
    seq = torch.searchsorted(ends, program, right=True)
    first = (program - (ends - blocks)[seq.clamp(max=B - 1)]) * cfg.BLOCK_M
    work = torch.stack([torch.where(seq < B, seq, -1), first]).to(torch.int32)
    out = torch.empty(T, H, D_V, dtype=q.dtype, device=q.device)
    args = dict(q_ptr=q, k_ptr=k_pages, v_ptr=v_pages, o_ptr=out, cu_seqlens_ptr=cu_seqlens_q,
                context_lens_ptr=context_lens, block_table_ptr=block_table, work_ptr=work,
                stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kp=k_pages.stride(0),
                stride_ks=k_pages.stride(1), stride_kh=k_pages.stride(2), stride_vp=v_pages.stride(0),
                stride_vs=v_pages.stride(1), stride_vh=v_pages.stride(2), stride_ot=out.stride(0),
                stride_oh=out.stride(1), stride_bt=block_table.stride(0), NUM_WORK=num_work, H=H, D_QK=D_QK,
                D_V=D_V, qk_scale=scale * LOG2E, window=window, GROUP=H // k_pages.shape[2],
                HAS_WINDOW=window > 0, BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_D=block_d,
                BLOCK_DR=block_dr, BLOCK_DV=block_dv, PAGE_SIZE=k_pages.shape[1],
                sinks_ptr=q if sinks is None else sinks, HAS_SINKS=sinks is not None, **kv_args,
                alibi_ptr=q if alibi_slopes is None else alibi_slopes * LOG2E, HAS_ALIBI=alibi_slopes is not None,
                V_PAIRS=cfg.v_pairs and bool(kv_args))
    return Launch(_paged_prefill_kernel, (num_work, H), args, cfg.num_warps, cfg.num_stages), out
