"""Typed weights: what a format loader hands to the model, whatever the checkpoint format, and
everything done to one that does not depend on a kernel.

Shapes use the linear-layer notation y = x @ W^T with W [N, K] (N outputs, K inputs). A weight
is 2-D (one linear) or stacked with a leading expert dim E (MoE experts, `stack_experts`): then
every tensor field gains that dim. The classes are frozen dataclasses; each one knows its own
layout: shape, the device move, dequantization, fusing along N (`concat_outputs`), stacking
experts and taking one back out (`expert`), the checks of a stacked layout.

Adding a weight type: its class here, its GEMM kernel in tritonq/kernels/, and its row in
`tritonq.layers.GEMMS`, the one table that picks a GEMM by type (kernels/moe.py's `_weight_args`
and kernels/cpu_lowbit.py's `_prepare` too, if MoE experts or the CPU backend should run it).
The kernels import these types for their signatures and checks, so this module imports no kernel
(the GEMM table sits in layers.py, above both): tests/test_import_graph.py keeps the graph acyclic.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from tritonq.packing import unpack_int32


class _TypedWeight:
    """What every typed weight does the same way, from its tensor fields."""
    bias: torch.Tensor | None

    @property
    def values(self) -> torch.Tensor:
        """The tensor of weight values (dense or fp8 `weight`, packed int `qweight`)."""
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): the values' shape (dense and fp8 store W [N, K]; Int4Weight derives it from its packing)."""
        return tuple(self.values.shape)

    @property
    def device(self) -> torch.device:
        return self.values.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (None fields left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self, device):
        """The same typed weight with every tensor field moved to `device`."""
        return replace(self, **{name: t.to(device) for name, t in self.tensors().items()})

    @property
    def num_experts(self) -> int:
        """E of a stacked weight (leading expert dim)."""
        return self.values.shape[0]

    def expert(self, e: int):
        """Expert e of a stacked weight, as a 2-D typed weight of the same type (views, no copies)."""
        return replace(self, **{name: t[e] for name, t in self.tensors().items()})


@dataclass(frozen=True)
class DenseWeight(_TypedWeight):
    """weight [N, K] fp16/bf16/fp32; bias [N] or None."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def values(self) -> torch.Tensor:
        return self.weight

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] as stored (dtype None) or converted to dtype."""
        return self.weight if dtype is None else self.weight.to(dtype)

    def scales_constant_over(self, block_k: int) -> bool:
        return False  # no scales

    def stacked_shape(self, what: str) -> tuple[int, int, int]:
        """(E, N, K) of a stacked weight; ValueError (prefixed by `what`) if it is not stacked."""
        if self.weight.dim() != 3:
            _not_stacked(self, what)
        return tuple(self.weight.shape)

    @classmethod
    def _concat_outputs(cls, parts: list[DenseWeight], bias: torch.Tensor | None) -> DenseWeight:
        return cls(torch.cat([p.weight for p in parts]), bias)

    @classmethod
    def _stack_experts(cls, parts: list[DenseWeight]) -> DenseWeight:
        return cls(_stack(parts, "weight"), _stack(parts, "bias"))


@dataclass(frozen=True)
class Int4Weight(_TypedWeight):
    """Integer weights in tritonq's one internal layout (both AWQ and GPTQ are repacked into it).

    qweight [K * bits / 32, N] int32: packed along K, sequential order: row r, field i holds
            input row k = r * (32 // bits) + i, bits (4 or 8) wide, at bit offset i * bits.
    scales  [G, N] fp16/bf16, G = number of groups along K.
    zeros   [G, N] same dtype as scales, integer-valued (already unpacked, v1 offset removed),
            or None for symmetric weights (zero = 2^(bits-1)).
    g_idx   [K] int32 group of each input row (act-order), or None: group of row k = k // group_size.
    group_size: rows per group (K for per-channel quantization).
    Dequant: W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n].
    """
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    group_size: int
    bits: int = 4
    bias: torch.Tensor | None = None

    @property
    def values(self) -> torch.Tensor:
        return self.qweight

    @property
    def shape(self) -> tuple[int, int]:
        return (self.qweight.shape[1], self.qweight.shape[0] * 32 // self.bits)

    def check_g_idx(self) -> None:
        """ValueError unless every g_idx entry names a row of scales. It syncs the device, so CUDA
        launches skip it; the GPTQ loader checks at load time."""
        if self.g_idx is not None and not self.g_idx.is_meta:  # meta: a dry run, no values
            lo, hi = int(self.g_idx.min()), int(self.g_idx.max())
            if lo < 0 or hi >= self.scales.shape[0]:
                raise ValueError(f"Int4Weight: g_idx is in range [{lo}, {hi}], expected in "
                                 f"[0, {self.scales.shape[0]}); g_idx must index scales rows")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] = (q - zero) * scale, computed in fp32 (exact: integers times one rounding of
        the scale), returned in dtype (None: the scales' dtype)."""
        self.check_g_idx()
        K = self.shape[1]
        q = unpack_int32(self.qweight, self.bits, dim=0).float()  # [K, N]
        g = self.g_idx.long() if self.g_idx is not None else torch.arange(K, device=q.device) // self.group_size
        zeros = self.zeros.float()[g] if self.zeros is not None else 2.0 ** (self.bits - 1)
        return ((q - zeros) * self.scales.float()[g]).t().to(dtype or self.scales.dtype)

    def scales_constant_over(self, block_k: int) -> bool:
        """True if each aligned run of block_k input rows lies in one group."""
        return self.g_idx is None and self.group_size % block_k == 0

    def stacked_shape(self, what: str) -> tuple[int, int, int]:
        """(E, N, K) of a stacked weight, checking scales and g_idx carry the expert dim too."""
        if self.qweight.dim() != 3:
            _not_stacked(self, what)
        if self.bits not in (4, 8):
            raise ValueError(f"{what} has bits={self.bits}; the expert kernel unpacks 4- or 8-bit weights")
        E, packed_k, N = self.qweight.shape
        K = packed_k * 32 // self.bits
        if self.scales.dim() != 3 or self.scales.shape[0] != E or self.scales.shape[2] != N:
            raise ValueError(f"{what} Int4 scales shape {tuple(self.scales.shape)} must be [E={E}, G, N={N}]")
        if self.g_idx is not None and (self.g_idx.shape != (E, K) or not self.g_idx.is_contiguous()):
            raise ValueError(f"{what} g_idx shape {tuple(self.g_idx.shape)} must be a contiguous "
                             f"[E={E}, K={K}] (the kernel indexes it as expert * K + k)")
        return E, N, K

    @classmethod
    def _concat_outputs(cls, parts: list[Int4Weight], bias: torch.Tensor | None) -> Int4Weight:
        first = parts[0]
        keys = {(p.bits, p.group_size, p.zeros is None) for p in parts}
        if len(keys) != 1 or any(not _same(p.g_idx, first.g_idx) for p in parts):
            raise ValueError("cannot fuse int4 linears with different bits / group_size / symmetry / g_idx: "
                             f"found (bits, group_size, symmetric) {sorted(keys)}")
        return cls(torch.cat([p.qweight for p in parts], dim=-1), torch.cat([p.scales for p in parts], dim=-1),
                   None if first.zeros is None else torch.cat([p.zeros for p in parts], dim=-1),
                   first.g_idx, first.group_size, first.bits, bias)

    @classmethod
    def _stack_experts(cls, parts: list[Int4Weight]) -> Int4Weight:
        first = parts[0]
        found = sorted({(p.bits, p.group_size) for p in parts})
        if len(found) != 1:
            raise ValueError(f"experts of one MoE layer must share bits and group_size (one fused kernel runs them "
                             f"all); found (bits, group_size) {found}: quantize every expert of a layer alike")
        # Loaders drop zeros that are all 2^(bits-1) and a g_idx that is k // group_size, per expert; when only
        # some experts of a layer had them dropped, they are written back out (the same values) for all.
        if len({p.zeros is None for p in parts}) > 1:
            parts = [p if p.zeros is not None else replace(p, zeros=torch.full_like(p.scales, 2 ** (p.bits - 1)))
                     for p in parts]
        if len({p.g_idx is None for p in parts}) > 1:
            parts = [p if p.g_idx is not None else replace(p, g_idx=(torch.arange(
                p.shape[1], device=p.qweight.device) // p.group_size).to(torch.int32)) for p in parts]
        first = parts[0]
        return cls(_stack(parts, "qweight"), _stack(parts, "scales"), _stack(parts, "zeros"), _stack(parts, "g_idx"),
                   first.group_size, first.bits, _stack(parts, "bias"))


@dataclass(frozen=True)
class FP8Weight(_TypedWeight):
    """weight [N, K] float8_e4m3fn.

    weight_scale: fp32, shape [] (per tensor), [N, 1] (per output channel) or, with block_size
    (bn, bk), [ceil(N/bn), ceil(K/bk)] (DeepSeek-V3 `weight_scale_inv`): W = weight * scale.
    input_scale: fp32 [] for static activation scaling, or None for dynamic per-token scaling.
    weight_only: the checkpoint quantizes weights only (e.g. compressed-tensors with
    `input_activations: null`): activations stay in the compute dtype, never rounded to fp8.
    Stacked (experts): weight [E, N, K], weight_scale [E], [E, N, 1] or [E, ceil(N/bn), ceil(K/bk)].
    """
    weight: torch.Tensor
    weight_scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    weight_only: bool = False

    @property
    def values(self) -> torch.Tensor:
        return self.weight

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] = weight * weight_scale (broadcast per tensor / channel / block), computed in
        float32 and returned in dtype (None: float32)."""
        N, K = self.shape
        s = self.weight_scale.float()
        if self.block_size is not None:
            bn, bk = self.block_size
            s = s.repeat_interleave(bn, dim=0).repeat_interleave(bk, dim=1)[:N, :K]
        elif s.numel() != 1:
            s = s.reshape(N, 1)
        w = self.weight.float() * s
        return w if dtype is None else w.to(dtype)

    def scales_constant_over(self, block_k: int) -> bool:
        """True if each aligned run of block_k input rows shares one scale (per tensor / channel,
        or a K block that block_k divides)."""
        return self.block_size is None or self.block_size[1] % block_k == 0

    def stacked_shape(self, what: str) -> tuple[int, int, int]:
        """(E, N, K) of a stacked weight, checking weight_scale carries the expert dim too."""
        if self.weight.dim() != 3:
            _not_stacked(self, what)
        E, N, K = self.weight.shape
        s = self.weight_scale
        ok = (s.shape == (E, -(-N // self.block_size[0]), -(-K // self.block_size[1]))
              if self.block_size is not None else s.shape in ((E,), (E, N, 1)))
        if not ok:
            raise ValueError(f"{what} FP8 weight_scale shape {tuple(s.shape)} does not match weight "
                             f"[{E}, {N}, {K}] with block_size {self.block_size}; expected [E], [E, N, 1] or "
                             f"[E, ceil(N/bn), ceil(K/bk)]")
        return E, N, K

    @classmethod
    def _concat_outputs(cls, parts: list[FP8Weight], bias: torch.Tensor | None) -> FP8Weight:
        first = parts[0]
        if len({(p.block_size, p.input_scale is None, p.weight_only) for p in parts}) != 1:
            raise ValueError("cannot fuse fp8 linears with different block sizes, static/dynamic activation scales "
                             "or weight-only/activation-quantized schemes")
        if first.block_size is not None:
            if any(p.weight.shape[0] % first.block_size[0] for p in parts[:-1]):
                raise ValueError(f"cannot fuse block-fp8 linears whose N {[p.weight.shape[0] for p in parts]} "
                                 f"are not multiples of the block {first.block_size[0]}")
            scale = torch.cat([p.weight_scale for p in parts])
        elif all(p.weight_scale.numel() == 1 for p in parts) and (first.weight_scale.is_meta  # meta: a dry run
                                                                 or len({float(p.weight_scale) for p in parts}) == 1):
            scale = first.weight_scale
        else:  # different per-tensor scales become exact per-channel scales of the fused weight
            scale = torch.cat([p.weight_scale.reshape(-1, 1).expand(p.weight.shape[0], 1) for p in parts])
        # One static input scale for the fused input: the largest keeps every part in range (as vLLM does).
        input_scale = (None if first.input_scale is None
                       else torch.stack([p.input_scale.reshape(()) for p in parts]).max())
        return cls(torch.cat([p.weight for p in parts]), scale, first.block_size, input_scale, bias, first.weight_only)

    @classmethod
    def _stack_experts(cls, parts: list[FP8Weight]) -> FP8Weight:
        if parts[0].block_size is None and len({p.weight_scale.dim() for p in parts}) > 1:
            # per-tensor scales of some experts and per-channel ones of others (a fused gate|up whose two scales
            # differ becomes per channel): the per-tensor ones as the same value on every channel
            parts = [p if p.weight_scale.dim() else replace(
                p, weight_scale=p.weight_scale.reshape(1, 1).expand(p.weight.shape[0], 1).contiguous()) for p in parts]
        first = parts[0]
        if len({(p.block_size, p.weight_scale.shape, p.weight_only) for p in parts}) != 1:
            raise ValueError("experts of one MoE layer must share the fp8 scale layout and activation scheme")
        return cls(_stack(parts, "weight"), _stack(parts, "weight_scale"), first.block_size,
                   _stack(parts, "input_scale"), _stack(parts, "bias"), first.weight_only)


Weight = DenseWeight | Int4Weight | FP8Weight
WEIGHT_TYPES = (DenseWeight, Int4Weight, FP8Weight)


def k_major(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether dense linear weights W [N, K] on `device` in `dtype` are stored [K, N]-contiguous (W a
    transposed view): on CPU in fp32, MKL's decode GEMV (M = 1..8) streams W ~1.3x faster that way.
    fp16/bf16 and GPUs are faster as [N, K]. F.linear takes either layout unchanged."""
    return torch.device(device).type == "cpu" and dtype == torch.float32


def empty_linear(N: int, K: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialized W [N, K] in the layout `k_major` picks (a loader reads the weight straight into it)."""
    if k_major(device, dtype):
        return torch.empty(K, N, dtype=dtype, device=device).t()
    return torch.empty(N, K, dtype=dtype, device=device)


def concat_outputs(parts: list[Weight]) -> Weight:
    """Fuse linears that share their input (q/k/v, gate/up) by concatenating along N."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse linears of different types {sorted(k.__name__ for k in kinds)}; "
                         "a fused group must be all dense or all quantized the same way")
    bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    return type(parts[0])._concat_outputs(parts, bias)


def stack_experts(parts: list[Weight]) -> Weight:
    """Stack per-expert weights of one type into the same type with a leading expert dim E."""
    if len({type(p) for p in parts}) != 1:
        raise ValueError("experts of one MoE layer must all have the same weight type")
    return type(parts[0])._stack_experts(parts)


def _stack(parts: list, field: str) -> torch.Tensor | None:
    """torch.stack of one field over the parts (None if the first part has none)."""
    return None if getattr(parts[0], field) is None else torch.stack([getattr(p, field) for p in parts])


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    # meta tensors (a dry run of the load) have no values: the same when their shapes are
    return (a is None and b is None) or (a is not None and b is not None and (
        a.shape == b.shape if a.is_meta else torch.equal(a, b)))


def _not_stacked(w, what: str):
    raise ValueError(f"{what} must be a stacked DenseWeight/Int4Weight/FP8Weight with a leading expert "
                     f"dim (loader.get_stacked), got a {w.values.dim()}-D {type(w).__name__}")
