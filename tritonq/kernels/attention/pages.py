"""The paged KV cache's data: QuantizedPages (8-bit pages and their scales), their dequantization and
row reads, and the page layouts tests, the tuner and benchmarks build (`paged_cache`, `paged_prompts`).
Constants shared with the kernels (`jit.py`) live here too."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton.language as tl

LOG2E = 1.4426950408889634
KV_INT8_MAX = 127.0  # int8 KV codes are symmetric, -127 .. 127
KV_FP8_MAX = 448.0  # largest finite float8_e4m3fn: fp8 KV values saturate there
KV_SCALE_EPS = 1e-10  # floor on an int8 row's absmax, so an all-zero row gets a finite scale (and codes 0)
_KV_INT8_MAX = tl.constexpr(KV_INT8_MAX)  # the same numbers as seen from inside @triton.jit
_KV_FP8_MAX = tl.constexpr(KV_FP8_MAX)
_KV_SCALE_EPS = tl.constexpr(KV_SCALE_EPS)


@dataclass(frozen=True)
class QuantizedPages:
    """One layer's k (or v) pages in 8 bits with the scales that dequantize them: value = data x scale.

    data [P, page_size, Hkv, D]: float8_e4m3fn with scale [] fp32 (per tensor), or int8 with scale
    [P, page_size, Hkv] fp32 contiguous (per token and kv head, written with the values). MLA's latent
    v is QuantizedPages(k.data[..., :Dv], k.scale): the same scale tensor, so k and v share it.
    Passed wherever the kernels take k_pages / v_pages; models pass them on without looking inside."""
    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


def dequantize_pages(pages: torch.Tensor | QuantizedPages) -> torch.Tensor:
    """Plain torch: QuantizedPages -> float32 values [P, page_size, Hkv, D] (data x scale); plain pages as they are."""
    if not isinstance(pages, QuantizedPages):
        return pages
    scale = pages.scale if pages.scale.dim() == 0 else pages.scale[..., None]
    return pages.data.float() * scale


def read_kv_rows(pages: torch.Tensor | QuantizedPages, page_index: torch.Tensor, row_index: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """Rows pages[page_index, row_index] ([N, Hkv, D]) in dtype, dequantized from QuantizedPages (MLA's prefill
    reads the latent rows it expands this way)."""
    if not isinstance(pages, QuantizedPages):
        return pages[page_index, row_index].to(dtype)
    scale = pages.scale if pages.scale.dim() == 0 else pages.scale[page_index, row_index][..., None]
    return (pages.data[page_index, row_index].float() * scale).to(dtype)


def paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int, num_pages: int | None = None,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence k [B, S, Hkv, Dqk], v [B, S, Hkv, Dv] -> (k_pages, v_pages [num_pages, page_size, Hkv, D],
    block_table [B, ceil(S / page_size)] int32): each sequence's positions in pages taken in random order
    from a pool of num_pages (default: just enough); unused pages and rows hold random values, which the
    kernels must never read. For tests, the tuner and benchmarks."""
    B, S = k.shape[:2]
    per_seq = -(-S // page_size)
    num_pages = num_pages or B * per_seq
    if num_pages < B * per_seq:
        raise ValueError(f"paged_cache: {B} sequences of {S} tokens need {B * per_seq} pages of {page_size}, "
                         f"got num_pages = {num_pages}")
    made_on = generator.device if generator is not None else k.device  # a generator draws on its own device
    table = torch.randperm(num_pages, generator=generator, device=made_on)[:B * per_seq].view(B, per_seq)
    table = table.to(torch.int32)
    pages = []
    for x in (k, v):
        pool = torch.randn(num_pages, page_size, *x.shape[2:], generator=generator, device=made_on)
        pool = pool.to(x.device, x.dtype)
        padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, per_seq * page_size - S))
        pool[table.flatten().long().to(x.device)] = padded.reshape(B * per_seq, page_size, *x.shape[2:])
        pages.append(pool)
    return pages[0], pages[1], table.to(k.device)


def paged_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], page_size: int,
                  num_pages: int | None = None, generator: torch.Generator | None = None) -> tuple:
    """Whole prompts as the engine prefills them: right-padded q [B, S, H, Dqk], k [B, S, Hkv, Dqk],
    v [B, S, Hkv, Dv] with seq_lens [B] -> paged_prefill_attention's arguments before scale: (q packed
    [sum(seq_lens), H, Dqk], k_pages, v_pages, cu_seqlens_q, context_lens, block_table), pages as
    `paged_cache` lays them out. For tests, the tuner and benchmarks."""
    k_pages, v_pages, table = paged_cache(k, v, page_size, num_pages, generator)
    packed = torch.cat([q[b, :n] for b, n in enumerate(seq_lens)])
    cu_seqlens = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32, device=q.device)
    return packed, k_pages, v_pages, cu_seqlens, torch.tensor(seq_lens, dtype=torch.int32, device=q.device), table


def shares_scale(k_pages: QuantizedPages, v_pages: QuantizedPages) -> bool:
    """Whether k and v pages share one scale tensor (MLA's latent cache: v = k[..., :Dv])."""
    k_scale, v_scale = k_pages.scale, v_pages.scale
    return k_scale is v_scale or (k_scale.device.type != "meta" and k_scale.data_ptr() == v_scale.data_ptr())
