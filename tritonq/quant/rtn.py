"""Round-to-nearest quantizers: a float weight in, a typed weight (tritonq.quant.weights) out.

quantize_int4 (AWQ / GPTQ grids, 4 or 8 bits), quantize_fp8 (per tensor, channel or block),
quantize_mxfp4 (gpt-oss's E2M1 blocks with E8M0 scales) and quantize_w8a8 (compressed-tensors' int8).
The formats use them to quantize dense weights at load time and the writer (tritonq.quantize) to
write checkpoints; this module sits below both and imports only packing, weights and torch.
"""
from __future__ import annotations

import math

import torch

from tritonq.quant.packing import group_grid, pack_int32, quantize_column
from tritonq.quant.weights import E2M1_VALUES, MXFP4_GROUP, FP8Weight, Int4Weight, MXFP4Weight, W8A8Weight

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_int4(w: torch.Tensor, group_size: int = 128, sym: bool = False, bits: int = 4, act_order: bool = False,
                  *, min_zero: int = 0, scale_dtype: torch.dtype = torch.float16) -> Int4Weight:
    """RTN-quantize w [N, K] float into an Int4Weight (bits 4 or 8) with scales in scale_dtype.

    Asymmetric: scale = (max(w, 0) - min(w, 0)) / (2^b - 1), zero = round(-min / scale) clamped to
    [min_zero, 2^b - 1] (GPTQ v1 files cannot store zero 0: use min_zero=1). Symmetric (GPTQ):
    scale = 2 * amax / (2^b - 1), zero = 2^(b-1). Codes are rounded against the scale as stored.
    act_order: RTN has no activation statistics to order rows by, so row k joins group k % G;
    this writes a valid desc_act checkpoint (g_idx) with plain-RTN quality.
    """
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int4 expects a float [N, K] weight, got {w.dtype} {list(w.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"quantize_int4: bits={bits} is not supported (supported: 4, 8)")
    N, K = w.shape
    g = K if group_size == -1 else group_size
    if g <= 0 or K % g or K % (32 // bits):
        raise ValueError(f"quantize_int4: K={K} must be a multiple of group_size={group_size} and of {32 // bits}; "
                         "pick a group size that divides K (or -1 for one group), or leave the layer dense")
    G = K // g
    group_of_row = torch.arange(K) % G if act_order else torch.arange(K) // g
    rows = torch.argsort(group_of_row, stable=True)          # rows of group 0, then group 1, ...
    wg = w.float()[:, rows].reshape(N, G, g)
    scale, zero = group_grid(wg, bits, sym, min_zero, scale_dtype)
    codes = quantize_column(wg, scale[..., None], zero[..., None], bits).reshape(N, K)
    q = torch.empty_like(codes)
    q[:, rows] = codes
    return Int4Weight(qweight=pack_int32(q.T.to(torch.int32), bits, dim=0), scales=scale.T.to(scale_dtype).contiguous(),
                      zeros=None if sym else zero.T.to(scale_dtype).contiguous(),
                      g_idx=group_of_row.to(torch.int32) if act_order else None, group_size=g, bits=bits)


def quantize_fp8(w: torch.Tensor, scheme: str = "tensor", block_size: tuple[int, int] = (128, 128)) -> FP8Weight:
    """Quantize w [N, K] float to float8_e4m3fn with scale = amax / 448 per tensor, output row or block."""
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8 expects a float [N, K] weight, got {w.dtype} {list(w.shape)}")
    w = w.float()
    N, K = w.shape
    if scheme == "tensor":
        scale = w.abs().amax() / FP8_MAX
        full = scale
    elif scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale
    elif scheme == "block":
        bn, bk = block_size
        padded = torch.nn.functional.pad(w.abs(), (0, -K % bk, 0, -N % bn))
        scale = padded.reshape(math.ceil(N / bn), bn, math.ceil(K / bk), bk).amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    else:
        raise ValueError(f"quantize_fp8: scheme={scheme!r} is not supported (supported: tensor, channel, block)")
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    full = torch.where(full == 0, torch.ones_like(full), full)
    weight = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return FP8Weight(weight, scale.contiguous(), (bn, bk) if scheme == "block" else None)


# Largest E8M0 scale the MoE kernel builds with integer ops (kernels/moe/jit.py: 2^(s - 127) x 2^14 as fp32 bits).
MXFP4_MAX_SCALE = 240


def quantize_mxfp4(w: torch.Tensor) -> MXFP4Weight:
    """RTN-quantize w [..., N, K] float (K a multiple of 32) into MXFP4 blocks and E8M0 scales.

    Each group of 32 along K gets the smallest power-of-two scale 2^(s - 127) with amax / scale <= 6
    (e2m1's largest value, so nothing clips); each element is rounded to the nearest e2m1 value (ties
    to the larger magnitude)."""
    if w.ndim < 2 or not w.is_floating_point() or w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"quantize_mxfp4 expects a float [..., N, K] weight with K a multiple of {MXFP4_GROUP}, got "
                         f"{w.dtype} {list(w.shape)}")
    groups = w.float().contiguous().unflatten(-1, (-1, MXFP4_GROUP))  # [..., N, G, 32]
    amax = groups.abs().amax(-1)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scales = torch.where(amax > 0, exponent + 127, torch.full_like(amax, 127)).clamp(0, MXFP4_MAX_SCALE)
    scaled = torch.ldexp(groups, 127 - scales[..., None].to(torch.int32)).clamp(-6.0, 6.0)
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    codes = torch.bucketize(scaled.abs(), midpoints, right=True) | ((scaled < 0).to(torch.int64) << 3)
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))  # [..., N, G, 16, 2]: elements 2j, 2j + 1
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return MXFP4Weight(blocks.contiguous(), scales.to(torch.uint8).contiguous())


def quantize_w8a8(w: torch.Tensor, scheme: str = "channel") -> W8A8Weight:
    """RTN-quantize w [N, K] float to int8 codes for W8A8 as compressed-tensors does (calculate_qparams,
    symmetric): scale = absmax / 127.5 per output row (channel) or tensor, q = round(clamp(w / scale,
    -128, 127)) half to even; a zero scale becomes float32's eps. Activations: dynamic per token."""
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_w8a8 expects a float [N, K] weight, got {w.dtype} {list(w.shape)}")
    if scheme not in ("channel", "tensor"):
        raise ValueError(f"quantize_w8a8: scheme={scheme!r} is not supported (supported: channel, tensor)")
    w = w.float()
    absmax = w.abs().amax(dim=1, keepdim=True) if scheme == "channel" else w.abs().amax()
    scale = absmax / torch.full_like(absmax, 127.5)
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(torch.float32).eps), scale)
    codes = torch.round((w / scale).clamp(-128, 127)).to(torch.int8)
    return W8A8Weight(codes, scale.contiguous())
