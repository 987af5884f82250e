"""Bit packing shared by all integer formats, and the repack into tritonq's Int4Weight layout.

A packed int32 holds 32 // bits fields; field j sits at bits [j*bits, (j+1)*bits). Checkpoints
store int32 signed; we read them as uint32 bit patterns. AWQ interleaves the 8 columns of each
pack (field j holds column AWQ_ORDER[j]); GPTQ and our internal layout are sequential.
"""
from __future__ import annotations

import torch

from tritonq.formats.base import Int4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # field j holds column AWQ_ORDER[j]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c lives in field AWQ_REVERSE_ORDER[c]


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack integers in [0, 2^bits) along `dim` (size divisible by 32 // bits) into int32.

    order: field j of each pack takes element order[j] of its run (None = sequential).
    """
    per = 32 // bits
    v = values.movedim(dim, -1).to(torch.int64)
    if v.shape[-1] % per:
        raise ValueError(f"pack_int32: size {v.shape[-1]} along dim {dim} is not a multiple of {per}")
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(per, dtype=torch.int64, device=v.device) * bits
    packed = (v << shifts).sum(-1)
    packed = packed - (packed >= 2**31).to(torch.int64) * 2**32  # uint32 bit pattern -> int32
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of pack_int32: int32 -> int32 values in [0, 2^bits), `dim` grows by 32 // bits.

    order: the same `order` given to pack_int32 (fields are put back in element order).
    """
    per = 32 // bits
    p = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=p.device) * bits
    fields = (p.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inverse = [0] * per
        for j, c in enumerate(order):
            inverse[c] = j
        fields = fields[..., inverse]
    return fields.reshape(*p.shape[:-1], -1).to(torch.int32).movedim(-1, dim).contiguous()


def _trivial_g_idx(g_idx: torch.Tensor, group_size: int) -> bool:
    return torch.equal(g_idx.long().cpu(), torch.arange(g_idx.numel()) // group_size)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> Int4Weight:
    """AWQ GEMM layout (qweight [K, N/8], qzeros [G, N/8] interleaved, scales [G, N]) -> Int4Weight."""
    q = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER)  # [K, N]
    K = q.shape[0]
    zeros = None if qzeros is None else unpack_int32(qzeros, 4, dim=1, order=AWQ_ORDER).to(scales.dtype)
    return Int4Weight(qweight=pack_int32(q, 4, dim=0), scales=scales, zeros=zeros, g_idx=None,
                      group_size=K if group_size == -1 else group_size, bits=4, bias=bias)


def gptq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, bits: int, group_size: int, sym: bool, zero_offset: int,
                 bias: torch.Tensor | None = None) -> Int4Weight:
    """GPTQ layout (qweight [K*b/32, N] sequential along K, qzeros [G, N*b/32]) -> Int4Weight.

    zero_offset: added to every unpacked zero field as is (no wrap, no borrow); GPTQLoader decodes v1
    words itself (see formats/gptq.py) and passes 0.
    sym: zeros are 2^(bits-1) everywhere and are not kept (the kernel's symmetric branch).
    A g_idx equal to k // group_size over scales of K / group_size rows carries no information and is
    dropped (a row shard of an act-order layer keeps all scales rows, and its g_idx, whatever it holds).
    """
    K = qweight.shape[0] * 32 // bits
    group_size = K if group_size == -1 else group_size
    zeros = None
    if not sym:
        zeros = (unpack_int32(qzeros, bits, dim=1) + zero_offset).to(scales.dtype)
    if g_idx is not None and scales.shape[0] == K // group_size and _trivial_g_idx(g_idx, group_size):
        g_idx = None
    if g_idx is not None and (tuple(g_idx.shape) != (K,)
                              or int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]):
        raise ValueError(f"gptq_to_int4: g_idx of shape {tuple(g_idx.shape)} with values in [{int(g_idx.min())}, "
                         f"{int(g_idx.max())}], expected [{K}] in [0, {scales.shape[0]}) (one group per scales row); "
                         "the checkpoint's g_idx does not match its scales")
    return Int4Weight(qweight=qweight.contiguous(), scales=scales, zeros=zeros,
                      g_idx=None if g_idx is None else g_idx.to(torch.int32).contiguous(),
                      group_size=group_size, bits=bits, bias=bias)


def int4_to_awq(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4Weight (bits 4, no g_idx) -> AWQ (qweight [K, N/8], qzeros [G, N/8], scales [G, N])."""
    if w.bits != 4 or w.g_idx is not None:
        raise ValueError(f"AWQ stores 4-bit weights without act-order; got bits={w.bits}, g_idx={w.g_idx is not None}")
    q = unpack_int32(w.qweight, 4, dim=0)  # [K, N]
    zeros = w.zeros if w.zeros is not None else torch.full_like(w.scales, 8)
    return (pack_int32(q, 4, dim=1, order=AWQ_ORDER),
            pack_int32(zeros.round().to(torch.int32), 4, dim=1, order=AWQ_ORDER), w.scales)
