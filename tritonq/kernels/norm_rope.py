"""RMSNorm and rotary position embeddings (rotate-half convention, as in HF Llama).

rms_norm(x [..., D] fp16/bf16/fp32, weight [D], eps) -> [..., D] in x.dtype:
    y = x / sqrt(mean(x^2) + eps) * weight, statistics in float32.
add_rms_norm(x, h, weight, eps) -> (x + h, rms_norm(x + h)): a pre-norm layer's residual addition and the norm
    after it, in one pass (one launch on a GPU, one C loop on the CPU backend).
silu_mul(gate_up [..., 2I]) -> silu(gate) * up [..., I]: SwiGLU's activation between the gate_up and down
    linears, one pass (one launch on a GPU, one C loop on the CPU backend).
rope_cos_sin(head_dim, base, num_positions, rope_scaling, max_position_embeddings)
    -> (cos, sin) tables [num_positions, head_dim] float32 for rope types
    default / linear / dynamic / llama3 / yarn (yarn's attention factor is folded into the tables).
apply_rope(x [B, S, H, D], cos [B, S, D], sin [B, S, D]) -> [B, S, H, D] in x.dtype:
    x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[D/2:], x[:D/2]), where cos/sin are the
    table rows at x's positions (cos_table[positions]): models gather them once per forward for all layers.
RMSNorm (with or without the residual addition) and SiLU-mul have Triton kernels (one program per row, or per
block of a row) and on the CPU backend C loops per row (kernels/cpu/native.py); the rope tables are tiny and built
in torch. On a GPU, rope itself runs inside the KV write (attention.rope_write_kv_slots), so apply_rope is the
CPU backend's and the references' path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tritonq.kernels import backend
from tritonq.kernels.cpu import native as cpu_native
from tritonq.kernels.common import Launch


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, D, eps, BLOCK_D: tl.constexpr, h_ptr=None,
                     sum_ptr=None, stride_h=0, stride_sum=0, HAS_ADD: tl.constexpr = False):
    """One program normalizes one row; the whole row fits in one block (D <= 16384).
    HAS_ADD: the row is x + h (rounded to x's dtype, as torch's addition), stored to sum_ptr, then normalized."""
    row = tl.program_id(0).to(tl.int64)  # row x stride: past 2^31 elements for R * D >= 2^31
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_ADD:
        x += tl.load(h_ptr + row * stride_h + offs, mask=mask, other=0.0)
        tl.store(sum_ptr + row * stride_sum + offs, x, mask=mask)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * rstd * w
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; see the module docstring."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm: weight must be [D] with D = x.shape[-1]; got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}.")
    b = backend(x)
    if b != "triton":  # the C loop where it takes the call, else the reference (what a compiled step traces)
        y = cpu_native.rms_norm(x, weight, eps) if b == "cpu" else None
        return rms_norm_reference(x, weight, eps) if y is None else y
    D = x.shape[-1]
    if D > 16384:
        raise ValueError(f"rms_norm: hidden size {D} exceeds the one-block kernel's limit of 16384.")
    launch, y = rms_norm_launch(_rows(x), weight, eps)
    launch()
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h, weight, eps)) for x, h [..., D] of one dtype; see the module docstring. On the CPU
    backend one C pass (the sum rounded to the dtype as torch's addition rounds it, so the same values)."""
    if x.shape != h.shape or x.dtype != h.dtype:
        raise ValueError(f"add_rms_norm: x and h must match; got x {x.dtype} {tuple(x.shape)}, h {h.dtype} "
                         f"{tuple(h.shape)}.")
    b = backend(x)
    if b == "cpu" and (fused := cpu_native.rms_norm(x, weight, eps, add=h)) is not None:
        return fused
    D = x.shape[-1]
    if b != "triton" or D > 16384 or weight.shape != (D,):  # the reference; rms_norm refuses what it must
        total = x + h
        return total, rms_norm(total, weight, eps)
    rows, h_rows = (_rows(t) for t in (x, h))
    launch, y, total = rms_norm_launch(rows, weight, eps, add=h_rows)
    launch()
    return total.view(x.shape), y.view(x.shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as rows [R, D] with the last dim contiguous (a view when it already is)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_launch(rows: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None):
    """The launch of _rms_norm_kernel over rows [R, D] (last dim contiguous, D <= 16384) and its output
    [R, D]: one program per row, a warp per 256 lanes (at most 16). Over meta tensors the AOT tests compile it.
    add [R, D] (last dim contiguous): normalize rows + add instead; returns (launch, y, the sum [R, D])."""
    y = torch.empty_like(rows)
    block = triton.next_power_of_2(rows.shape[-1])
    args = dict(x_ptr=rows, w_ptr=weight, y_ptr=y, stride_x=rows.stride(0), stride_y=y.stride(0), D=rows.shape[-1],
                eps=eps, BLOCK_D=block)
    total = None
    if add is not None:
        total = torch.empty_like(rows)
        args.update(h_ptr=add, sum_ptr=total, stride_h=add.stride(0), stride_sum=total.stride(0), HAS_ADD=True)
    launch = Launch(_rms_norm_kernel, (rows.shape[0],), args, min(max(block // 256, 1), 16), 3)
    return (launch, y) if add is None else (launch, y, total)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, INTER, BLOCK: tl.constexpr):
    """Program (row, block): y[row, cols] = silu(gate) * up for gate = x[row, cols], up = x[row, INTER + cols],
    in fp32, rounded once to y's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: gate_up [..., 2I] (gate first, up second) -> silu(gate) * up [..., I]; see the module
    docstring. Torch's ops on the references' path and under torch.compile (inductor fuses them)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: gate_up's last dim must be even (gate then up, I each); got "
                         f"{tuple(gate_up.shape)}.")
    b = backend(gate_up)
    if b == "cpu" and (y := cpu_native.silu_mul(gate_up)) is not None:
        return y
    if b != "triton" or torch.compiler.is_compiling():
        return silu_mul_reference(gate_up)
    launch, y = silu_mul_launch(_rows(gate_up))
    launch()
    return y.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def silu_mul_launch(rows: torch.Tensor) -> tuple[Launch, torch.Tensor]:
    """The launch of _silu_mul_kernel over rows [R, 2I] (last dim contiguous) and its output [R, I]: 1024-wide
    blocks of a row per program (fewer for small I), 4 warps. Over meta tensors the AOT tests compile it."""
    inter = rows.shape[-1] // 2
    y = torch.empty(rows.shape[0], inter, dtype=rows.dtype, device=rows.device)
    block = min(1024, triton.next_power_of_2(inter))
    args = dict(x_ptr=rows, y_ptr=y, stride_x=rows.stride(0), stride_y=y.stride(0), INTER=inter, BLOCK=block)
    return Launch(_silu_mul_kernel, (rows.shape[0], triton.cdiv(inter, block)), args, 4, 1), y


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Plain torch: silu(gate) * up in gate_up's dtype (transformers' LlamaMLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch: normalized in float32 (torch's fused rms_norm), then cast back to x.dtype and times
    the weight, as HF Llama does."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, linear ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):  # the dim index whose wavelength makes `rotations` turns
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short kept, smooth blend in between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(head_dim: int, base: float, num_positions: int, rope_scaling: dict | None = None,
                 max_position_embeddings: int = 2048, device: torch.device | str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [num_positions, head_dim] float32 (see the module docstring).

    rope_scaling is the config's dict (`rope_type` or legacy `type`: default|linear|dynamic|llama3|yarn).
    Dynamic NTK depends on the sequence length: call with num_positions = the longest position + 1,
    as transformers does per forward.
    """
    scaling = dict(rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    attention_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "dynamic":
        original = scaling.get("original_max_position_embeddings", max_position_embeddings)
        if num_positions > original:
            factor = scaling["factor"]
            base = base * ((factor * num_positions / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
            inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(inv_freq, head_dim, base, scaling)
    elif kind != "default":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; expected one of "
                         "default, linear, dynamic, llama3, yarn.")
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return ((angles.cos() * attention_factor).to(device), (angles.sin() * attention_factor).to(device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by cos/sin [B, S, D], the table rows at x's positions; see the module docstring."""
    if cos.shape != x.shape[:2] + x.shape[-1:] or sin.shape != cos.shape:
        raise ValueError(f"apply_rope: expected x [B,S,H,D] and cos/sin [B,S,D] (the table rows at x's positions); "
                         f"got x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}.")
    if backend(x) == "cpu" and (y := cpu_native.rope(x, cos.to(x.dtype), sin.to(x.dtype))) is not None:
        return y  # one C loop (a compiled step traces the ops below, which inductor fuses)
    c, s = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)  # no-ops when the model gathered in x.dtype
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * c, rotated, s)
