"""Integer codes: the quantization grid (float -> code, shared by the RTN quantizer and the GPTQ / AWQ
calibrations) and the bit packing shared by all integer formats and by tritonq's Int4Weight layout
(tritonq/quant/weights.py).

A packed int32 holds 32 // bits fields; field j sits at bits [j*bits, (j+1)*bits). Checkpoints
store int32 signed; we read them as uint32 bit patterns. AWQ interleaves the 8 columns of each
pack (field j holds column AWQ_ORDER[j]); GPTQ and our internal layout are sequential.
The repacks of whole checkpoints into Int4Weight live with their formats (formats/awq.py, gptq.py).
"""
from __future__ import annotations

import torch

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


def group_grid(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0,
               scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [N] (float32) of the group columns w [N, g], the grid of tritonq.quant.rtn.quantize_int4
    and of the calibrations (tritonq.quantize.calibrate).

    Asym: scale = (max(w, 0) - min(w, 0)) / (2^b - 1), zero = round(-min / scale) clamped to
    [min_zero, 2^b - 1]; sym: scale = 2 amax / (2^b - 1), zero = 2^(b-1). The scale is rounded to
    scale_dtype (what the file stores) before codes are computed against it.
    """
    maxq = 2**bits - 1
    if sym:
        scale = 2 * w.abs().amax(-1) / maxq
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = (high - low) / maxq
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(scale_dtype).float()
    zero = torch.full_like(scale, 2 ** (bits - 1)) if sym else (-low / scale).round().clamp(min_zero, maxq)
    return scale, zero


def quantize_column(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes of w (any shape broadcasting with scale/zero) on the grid."""
    return ((w / scale).round() + zero).clamp(0, 2**bits - 1)
