"""Typed weights: what a format loader hands to the model, whatever the checkpoint format, and
everything done to one that does not depend on a kernel.

Shapes use the linear-layer notation y = x @ W^T with W [N, K] (N outputs, K inputs). A weight
is 2-D (one linear) or stacked with a leading expert dim E (MoE experts, `stack_experts`): then
every tensor field gains that dim. The classes are frozen dataclasses; each one knows its own
layout: shape, the device move, dequantization, fusing along N (`concat_outputs`), stacking
experts and taking one back out (`expert`), the checks of a stacked layout.

Adding a weight type: its class here, its GEMM kernel in tritonq/kernels/, and its row in
`tritonq.kernels.linear.LINEARS`, the one table of (prepare once, run per call) by type (kernels/moe/launch.py's
`_weight_args` and kernels/cpu/lowbit.py's `_prepare` too, if MoE experts or the CPU backend should run it).
The kernels import these types for their signatures and checks, so this module imports no kernel
(the table sits in kernels/linear.py, above both): tests/repo/test_import_graph.py keeps the graph acyclic.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import torch

from tritonq.quant.packing import unpack_int32


class _TypedWeight:
    """What every typed weight does the same way, from its tensor fields."""
    bias: torch.Tensor | None
    __dataclass_fields__: ClassVar[dict[str, Any]]  # every subclass is a dataclass (for fields / replace)

    @property
    def values(self) -> torch.Tensor:
        """The tensor of weight values (dense or fp8 `weight`, packed int `qweight`)."""
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
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

    def take_outputs(self, index: torch.Tensor):
        """The weight with output rows (N) reordered / selected by index [N'] (every tensor field whose
        N dim is `output_dims` names; the bias too; a per-tensor scale, which has no N dim, stays). For the types
        that declare their N dims."""
        dims = getattr(self, "output_dims", None)
        if dims is None:
            raise ValueError(f"{type(self).__name__} cannot reorder its output rows (take_outputs)")
        stacked = self.values.dim() - dims["values_rank"]  # 1 for a stacked weight (leading E), else 0
        return replace(self, **{name: t.index_select(dims[name] + stacked, index.to(t.device))
                                for name, t in self.tensors().items() if name in dims and t.dim() > dims[name] + stacked})


@dataclass(frozen=True)
class DenseWeight(_TypedWeight):
    """weight [N, K] fp16/bf16/fp32; bias [N] or None."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    output_dims = {"weight": 0, "bias": 0, "values_rank": 2}  # each field's N dim, unstacked (take_outputs)

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
        E, N, K = self.weight.shape
        return E, N, K

    @classmethod
    def _concat_outputs(cls, parts: list[DenseWeight], bias: torch.Tensor | None) -> DenseWeight:
        return cls(torch.cat([p.weight for p in parts]), bias)

    @classmethod
    def _stack_experts(cls, parts: list[DenseWeight]) -> DenseWeight:
        return cls(_stack(parts, "weight"), _stack_optional(parts, "bias"))


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
    code    fp32 [16] or None. With it (bitsandbytes nf4 / fp4: bits 4, zeros and g_idx None) a 4-bit q is
            an index into this code table, not an integer level, and scales are the blocks' absmax.
    perm    int32 [K] or None: the rows are stored in another order than x's columns, stored row j being x's
            column perm[j] (an act-order weight sorted by group for the GPU kernel, `kernels.int4_gemm.sort_act_order`:
            g_idx None, its groups plain runs). y = x[:, perm] @ W_stored^T.
    Dequant: W[n, k] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n];  with code: code[q[k, n]] * scales[g(k), n]
    (columns put back in x's order where perm is set).
    """
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    group_size: int
    bits: int = 4
    bias: torch.Tensor | None = None
    code: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    output_dims = {"qweight": 1, "scales": 1, "zeros": 1, "bias": 0, "values_rank": 2}  # each field's N dim

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
        """W [N, K] = (q - zero) * scale (or code[q] * scale), computed in fp32 (exact: integers times one
        rounding of the scale; one fp32 product with a code), returned in dtype (None: the scales' dtype)."""
        self.check_g_idx()
        K = self.shape[1]
        q = unpack_int32(self.qweight, self.bits, dim=0)  # [K, N]
        g = self.g_idx.long() if self.g_idx is not None else torch.arange(K, device=q.device) // self.group_size
        if self.code is not None:
            w = self.code.float()[q.long()] * self.scales.float()[g]
        else:
            zeros = self.zeros.float()[g] if self.zeros is not None else 2.0 ** (self.bits - 1)
            w = (q.float() - zeros) * self.scales.float()[g]
        if self.perm is not None:  # stored row j is column perm[j]
            w = torch.empty_like(w).index_copy_(0, self.perm.long(), w)
        return w.t().to(dtype or self.scales.dtype)

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
        if len(keys) != 1 or any(not _same(p.g_idx, first.g_idx) or not _same(p.code, first.code) for p in parts):
            raise ValueError("cannot fuse int4 linears with different bits / group_size / symmetry / g_idx / code "
                             f"table: found (bits, group_size, symmetric) {sorted(keys)}")
        return cls(torch.cat([p.qweight for p in parts], dim=-1), torch.cat([p.scales for p in parts], dim=-1),
                   None if first.zeros is None else torch.cat(_present([p.zeros for p in parts]), dim=-1),
                   first.g_idx, first.group_size, first.bits, bias, first.code)

    @classmethod
    def _stack_experts(cls, parts: list[Int4Weight]) -> Int4Weight:
        first = parts[0]
        if first.code is not None:  # the expert kernel (kernels/moe/jit.py) dequantizes integer levels only
            raise ValueError("MoE experts with a 4-bit code table (bitsandbytes nf4/fp4) are not supported; "
                             "load a dense, AWQ, GPTQ or FP8 checkpoint of this MoE model")
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
        return cls(_stack(parts, "qweight"), _stack(parts, "scales"), _stack_optional(parts, "zeros"), _stack_optional(parts, "g_idx"),
                   first.group_size, first.bits, _stack_optional(parts, "bias"))


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
    output_dims = {"weight": 0, "weight_scale": 0, "bias": 0, "values_rank": 2}  # per channel; see take_outputs

    def take_outputs(self, index: torch.Tensor) -> FP8Weight:
        """As _TypedWeight's; refused for block scales, whose one scale covers block_size[0] rows."""
        if self.block_size is not None:
            raise ValueError(f"FP8Weight with block scales {self.block_size} cannot reorder its output rows: a scale "
                             "covers a block of rows; keep the stored order")
        return super().take_outputs(index)

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
                       else torch.stack([s.reshape(()) for s in _present([p.input_scale for p in parts])]).max())
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
                   _stack_optional(parts, "input_scale"), _stack_optional(parts, "bias"), first.weight_only)


# e2m1 code -> value (sign bit 3, exponent bits 1-2, mantissa bit 0): the OCP microscaling FP4 element.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # elements along K sharing one E8M0 scale


@dataclass(frozen=True)
class MXFP4Weight(_TypedWeight):
    """OCP microscaling FP4 (MXFP4) as gpt-oss checkpoints store their experts (quant_method "mxfp4").

    blocks [N, K / 32, 16] uint8: two e2m1 codes per byte, element 2j of a group in the low nibble and
           2j + 1 in the high one (transformers' integrations/mxfp4.py).
    scales [N, K / 32] uint8 E8M0: group g of row n is multiplied by 2^(scales[n, g] - 127).
    bias   [N] or None.
    Dequant: W[n, k] = E2M1_VALUES[code(n, k)] * 2^(scales[n, k // 32] - 127), exact in fp32.
    Stacked (experts): blocks [E, N, K / 32, 16], scales [E, N, K / 32], bias [E, N]. Experts only: Linear
    refuses it (no dense-layer GEMM reads it; gpt-oss keeps attention and the head in bf16).
    """
    blocks: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None = None
    output_dims = {"blocks": 0, "scales": 0, "bias": 0, "values_rank": 3}  # each field's N dim, unstacked

    @property
    def values(self) -> torch.Tensor:
        return self.blocks

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[-3], self.blocks.shape[-2] * MXFP4_GROUP)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] (or [E, N, K] stacked) in dtype (None: float32): table lookup and ldexp, exact in fp32
        up to scales of 2^127 (fp32's range; E8M0 reaches 2^127 x 6)."""
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=self.blocks.device)
        codes = torch.stack([self.blocks & 15, self.blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: k order
        values = table[codes].flatten(-2)  # [..., N, G, 32]
        w = torch.ldexp(values, self.scales.to(torch.int32)[..., None] - 127).flatten(-2)
        return w if dtype is None else w.to(dtype)

    def scales_constant_over(self, block_k: int) -> bool:
        return MXFP4_GROUP % block_k == 0

    def stacked_shape(self, what: str) -> tuple[int, int, int]:
        """(E, N, K) of a stacked weight, checking the blocks and scales layout."""
        if self.blocks.dim() != 4:
            _not_stacked(self, what)
        E, N, G, width = self.blocks.shape
        if (width != 16 or self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8
                or self.scales.shape != (E, N, G) or not self.blocks.is_contiguous()):
            raise ValueError(f"{what} MXFP4 blocks {self.blocks.dtype} {tuple(self.blocks.shape)} / scales "
                             f"{self.scales.dtype} {tuple(self.scales.shape)}: expected contiguous uint8 blocks "
                             f"[E, N, K/32, 16] and uint8 scales [E, N, K/32]")
        return E, N, G * MXFP4_GROUP

    @classmethod
    def _concat_outputs(cls, parts: list[MXFP4Weight], bias: torch.Tensor | None) -> MXFP4Weight:
        return cls(torch.cat([p.blocks for p in parts]), torch.cat([p.scales for p in parts]), bias)

    @classmethod
    def _stack_experts(cls, parts: list[MXFP4Weight]) -> MXFP4Weight:
        return cls(_stack(parts, "blocks"), _stack(parts, "scales"), _stack_optional(parts, "bias"))




@dataclass(frozen=True)
class W8A8Weight(_TypedWeight):
    """INT8 weights with INT8 activations (compressed-tensors `int-quantized`, llm-compressor's W8A8).

    weight:       int8 [N, K] signed codes in [-128, 127]; W = weight * weight_scale.
    weight_scale: fp32 [] (per tensor) or [N, 1] (per output channel).
    input_scale:  fp32 [] static per-tensor activation scale, or None: activations are quantized
                  dynamically per token (one scale per row of x, absmax / 127.5 as compressed-tensors).
    input_zero_point: int32 [] (static asymmetric activations, with input_scale) or None (symmetric):
                  x ~= (q - input_zero_point) * input_scale.
    Activation codes: q = clamp(round_half_even(x / scale + zero_point), -128, 127).
    """
    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    output_dims = {"weight": 0, "weight_scale": 0, "bias": 0, "values_rank": 2}  # each field's N dim, unstacked

    @property
    def values(self) -> torch.Tensor:
        return self.weight

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] = weight * weight_scale in float32 (exact: an integer times one scale), returned in dtype
        (None: float32)."""
        s = self.weight_scale.float()
        w = self.weight.float() * (s if s.numel() == 1 else s.reshape(-1, 1))
        return w if dtype is None else w.to(dtype)

    def scales_constant_over(self, block_k: int) -> bool:
        return True  # per tensor / channel: one scale along all of K

    def stacked_shape(self, what: str) -> tuple[int, int, int]:
        raise ValueError(f"{what}: W8A8 (int8 x int8) MoE experts are not supported; the fused MoE kernel runs "
                         "dense, int4/int8 weight-only and fp8 experts")

    @classmethod
    def _concat_outputs(cls, parts: list[W8A8Weight], bias: torch.Tensor | None) -> W8A8Weight:
        first = parts[0]
        if len({(p.input_scale is None, p.input_zero_point is None) for p in parts}) != 1:
            raise ValueError("cannot fuse W8A8 linears with different activation schemes (dynamic / static, "
                             "symmetric / asymmetric)")
        if all(p.weight_scale.numel() == 1 for p in parts) and (first.weight_scale.is_meta  # meta: a dry run
                                                               or len({float(p.weight_scale) for p in parts}) == 1):
            scale = first.weight_scale
        else:  # different per-tensor scales become exact per-channel scales of the fused weight
            scale = torch.cat([p.weight_scale.reshape(-1, 1).expand(p.weight.shape[0], 1) for p in parts])
        input_scale, zero_point = first.input_scale, first.input_zero_point
        if input_scale is not None and zero_point is None:  # one symmetric scale: the largest keeps all in range
            input_scale = torch.stack([s.reshape(()) for s in _present([p.input_scale for p in parts])]).max()
        elif zero_point is not None:  # one asymmetric grid covering every part's range [lo, hi]
            s = torch.stack([s.reshape(()).float() for s in _present([p.input_scale for p in parts])])
            z = torch.stack([zp.reshape(()).float() for zp in _present([p.input_zero_point for p in parts])])
            lo, hi = ((-128 - z) * s).min(), ((127 - z) * s).max()
            input_scale = (hi - lo) / 255
            zero_point = torch.round(-128 - lo / input_scale).clamp(-128, 127).to(torch.int32)
        return cls(torch.cat([p.weight for p in parts]), scale, input_scale, zero_point, bias)

    @classmethod
    def _stack_experts(cls, parts: list[W8A8Weight]) -> W8A8Weight:
        raise ValueError("W8A8 (int8 x int8) MoE experts are not supported; the fused MoE kernel runs dense, "
                         "int4/int8 weight-only and fp8 experts")


@dataclass(frozen=True)
class GGUFWeight(_TypedWeight):
    """A GGUF block format that the int layout cannot express (Q4_1, Q5_x, Q2_K ... Q6_K, IQ4_x), repacked at load
    (formats/gguf.py) into planes a GEMM reads along N with the exact values of the format:

    lo       [K / 8, N] int32: the low 4 bits of each code, packed along K (Int4Weight's 4-bit packing).
    hi       [K * (bits - 4) / 32, N] int32 or None: the code's bits above 4 (1 for Q5_*, 2 for Q6_K), packed so.
    scales   [K / group, N] fp32: the format's d, or d * sub-block scale (exact in fp32: 11 x 8 bits).
    offsets  [K / group, N] fp32 or None: m (Q4_1 / Q5_1) or -dmin * sub-block min (Q4_K / Q5_K).
    zero     the code's fixed offset (Q5_0: 16, Q6_K: 32; else 0).
    code     fp32 [16] or None: IQ4_NL / IQ4_XS's non-uniform levels; with it a code q means code[q] (zero 0).
    Dequant, in fp32: W[n, k] = (q - zero) * scale (+ offset), or code[q] * scale: the gguf package's products and
    sums, whose products are exact in fp32, so the values are its values bit for bit. type_name names the format.
    Stacked (MoE experts, run by kernels/gguf_gemm.py's expert GEMM): every plane and code gain a leading E.
    """
    lo: torch.Tensor
    hi: torch.Tensor | None
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    bits: int
    zero: int
    type_name: str
    bias: torch.Tensor | None = None
    code: torch.Tensor | None = None
    output_dims = {"lo": 1, "hi": 1, "scales": 1, "offsets": 1, "bias": 0, "values_rank": 2}

    @property
    def values(self) -> torch.Tensor:
        return self.lo

    @property
    def shape(self) -> tuple[int, int]:
        return (self.lo.shape[-1], self.lo.shape[-2] * 8)

    def codes(self) -> torch.Tensor:
        """The unsigned codes q [K, N] (int32)."""
        q = unpack_int32(self.lo, 4, dim=0)
        if self.hi is not None:
            q |= unpack_int32(self.hi, self.bits - 4, dim=0) << 4
        return q

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] in fp32 (dtype None) or dtype: the format's values (class docstring)."""
        g = torch.arange(self.shape[1], device=self.lo.device) // self.group_size
        q = self.codes()
        w = (self.code[q.long()] if self.code is not None else (q - self.zero).float()) * self.scales[g]
        if self.offsets is not None:
            w = w + self.offsets[g]
        return w.t().to(dtype or torch.float32)

    def scales_constant_over(self, block_k: int) -> bool:
        return self.group_size % block_k == 0

    def stacked_shape(self, what: str) -> tuple[int, int, int]:
        """(E, N, K) of stacked experts (every plane with the leading E, contiguous; code [E, 16])."""
        if self.lo.dim() != 3:
            _not_stacked(self, what)
        E, (N, K) = self.lo.shape[0], self.shape
        groups = (E, K // self.group_size, N)
        expected = {"lo": (E, K // 8, N), "hi": (E, K * (self.bits - 4) // 32, N), "scales": groups,
                    "offsets": groups, "code": (E, 16)}
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is not None and (tuple(t.shape) != shape or not t.is_contiguous()):
                raise ValueError(f"{what} GGUF {self.type_name} {name} is {tuple(t.shape)}"
                                 f"{'' if t.is_contiguous() else ' (non-contiguous)'}, expected a contiguous "
                                 f"{list(shape)}: stack the experts with stack_experts")
        return E, N, K

    @classmethod
    def _concat_outputs(cls, parts: list[GGUFWeight], bias: torch.Tensor | None) -> GGUFWeight:
        first = parts[0]
        if len({p.type_name for p in parts}) != 1:
            raise ValueError(f"cannot fuse GGUF linears of different block types "
                             f"{sorted({p.type_name for p in parts})}")

        def cat(name):
            return None if getattr(first, name) is None else torch.cat([getattr(p, name) for p in parts], -1)
        return replace(first, lo=cat("lo"), hi=cat("hi"), scales=cat("scales"), offsets=cat("offsets"), bias=bias)

    @classmethod
    def _stack_experts(cls, parts: list[GGUFWeight]) -> GGUFWeight:
        found = sorted({(p.type_name, p.shape) for p in parts})
        if len(found) != 1:
            raise ValueError(f"experts of one MoE layer must share their GGUF block type and shape (one fused kernel "
                             f"runs them all); found {found}: re-quantize the model with llama-quantize, which gives "
                             "each expert tensor one type")

        def stack(name):
            return _stack_optional(parts, name)
        return replace(parts[0], lo=stack("lo"), hi=stack("hi"), scales=stack("scales"), offsets=stack("offsets"),
                       code=stack("code"), bias=stack("bias"))


@dataclass(frozen=True)
class PartsWeight(_TypedWeight):
    """A fused linear (q/k/v, gate/up) whose parts keep different types: GGUF's Q4_K_M mixes a Q6_K attn_v with
    Q4_K q / k in some layers, which no one kernel runs. parts: 2-D typed weights [N_i, K] (each with its own bias,
    if any), each run by its own GEMM; W [sum N_i, K] is their concatenation along N. Stacked (MoE experts whose
    gate and up differ in type): each part stacked [E, N_i, K], run by its own expert GEMM (kernels/moe)."""
    parts: tuple
    bias: None = None

    @property
    def values(self) -> torch.Tensor:
        return self.parts[0].values

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"parts.{i}.{name}": t for i, p in enumerate(self.parts) for name, t in p.tensors().items()}

    def to(self, device):
        return replace(self, parts=tuple(p.to(device) for p in self.parts))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K]: the parts' values concatenated, in dtype (None: float32)."""
        return torch.cat([p.dequantize(dtype or torch.float32) for p in self.parts])

    def scales_constant_over(self, block_k: int) -> bool:
        return False

    def expert(self, e: int) -> PartsWeight:
        return replace(self, parts=tuple(p.expert(e) for p in self.parts))

    def stacked_shape(self, what: str) -> tuple[int, int, int]:
        """(E, sum N_i, K) of stacked parts (each checked as its type checks itself)."""
        shapes = [p.stacked_shape(f"{what} part {i}") for i, p in enumerate(self.parts)]
        if len({(E, K) for E, _, K in shapes}) != 1:
            raise ValueError(f"{what}: its parts are stacked as {[list(s) for s in shapes]}, expected one E and K")
        return shapes[0][0], sum(N for _, N, _ in shapes), shapes[0][2]

    @classmethod
    def _concat_outputs(cls, parts: list[PartsWeight], bias: torch.Tensor | None) -> PartsWeight:
        return cls(tuple(q for p in parts for q in p.parts))

    @classmethod
    def _stack_experts(cls, parts: list[PartsWeight]) -> PartsWeight:
        kinds = sorted({tuple(type(q).__name__ for q in p.parts) for p in parts})
        if len(kinds) != 1:
            raise ValueError(f"experts of one MoE layer must split into the same typed parts; found {kinds}")
        return cls(tuple(stack_experts([p.parts[i] for p in parts]) for i in range(len(parts[0].parts))))


Weight = DenseWeight | Int4Weight | FP8Weight | MXFP4Weight | W8A8Weight | GGUFWeight | PartsWeight
WEIGHT_TYPES = (DenseWeight, Int4Weight, FP8Weight, MXFP4Weight, W8A8Weight, GGUFWeight, PartsWeight)


@dataclass(frozen=True)
class RankExperts:
    """The routed experts of one MoE layer one rank holds (WeightsLoader.get_experts), stacked for fused_moe:
    gate_up [E', 2I', D] (each expert's gate rows, then its up rows), down [E', D, I']; index i is global
    expert first + i. num_experts: E, the layer's routed experts over all ranks."""
    gate_up: Weight
    down: Weight
    first: int
    num_experts: int


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
    bias = None if parts[0].bias is None else torch.cat(_present([p.bias for p in parts]))
    return type(parts[0])._concat_outputs(parts, bias)  # type: ignore[arg-type]  # parts all share type(parts[0]) (checked)


def stack_experts(parts: list[Weight]) -> Weight:
    """Stack per-expert weights of one type into the same type with a leading expert dim E."""
    if len({type(p) for p in parts}) != 1:
        raise ValueError("experts of one MoE layer must all have the same weight type")
    return type(parts[0])._stack_experts(parts)  # type: ignore[arg-type]  # parts all share type(parts[0]) (checked)


def _stack(parts: list, field: str) -> torch.Tensor:
    """torch.stack of one (required) tensor field over the parts."""
    return torch.stack([getattr(p, field) for p in parts])


def _stack_optional(parts: list, field: str) -> torch.Tensor | None:
    """torch.stack of one optional field over the parts (None if the first part has none)."""
    return None if getattr(parts[0], field) is None else _stack(parts, field)


def _present(tensors: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The tensors of an optional field that the caller found on the first part, hence (checked) on all."""
    present = [t for t in tensors if t is not None]
    assert len(present) == len(tensors), "an optional field is set on some parts only"
    return present


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    # meta tensors (a dry run of the load) have no values: the same when their shapes are
    return (a is None and b is None) or (a is not None and b is not None and (
        a.shape == b.shape if a.is_meta else torch.equal(a, b)))


def _not_stacked(w, what: str):
    raise ValueError(f"{what} must be a stacked DenseWeight/Int4Weight/FP8Weight/MXFP4Weight with a leading expert "
                     f"dim (loader.get_stacked), got a {w.values.dim()}-D {type(w).__name__}")
