"""CPU backend for typed weights: torch's own CPU kernels over weights prepared once, in place of the references
of `int4_gemm`, `fp8_gemm` and `fused_moe` (which unpack and dequantize the whole weight on every call;
TRITONQ_BACKEND=torch still runs them: the test oracle). `prepare(w)` makes a weight's CPU form once (at load),
`linear(x, p)` runs it.

* `CPUInt4Weight`: 4-bit AWQ / GPTQ for torch's int4 CPU kernel (bf16 activations, fp32 accumulation); above
  TEMPLATE_ABOVE_M rows inductor's int4 GEMM template, compiled once per weight (`_template_gemm`).
* `CPUInt8Weight`: symmetric 8-bit group weights (GGUF Q8_0, GPTQ 8-bit sym without act-order) kept as int8
  codes and float32 scales (1.125 bytes a weight at group 32), run at every row count by the C library's int8
  linear (`cpu_native.int8_linear`: each weight's float value made in registers; faster than the fp32 copy's
  MKL GEMV it replaces, docs/cpu.md); an fp32 copy where the C library is not built.
* `GGUFWeight` (GGUF's Q4_1 ... Q6_K, IQ4, linears and experts): kept in its planes as loaded, run at every row
  count by the C library's GGUF linear (`cpu_native.gguf_linear`: each weight's float32 value, the gguf package's,
  made in registers); an fp32 copy where the C library is not built.
* `CPUDenseWeight`: every other type (other 8-bit, nf4 / fp4, FP8, MXFP4, int4 the kernel cannot take), dequantized once
  to fp32 and run as an fp32 GEMM.

In the batch-invariant mode 4-bit weights run the eager kernel at every row count and dequantized ones the C loop
(the int8 and GGUF linears are batch-invariant as they are).
Each path's tolerance (tests/kernels/cpu/test_cpu_lowbit.py) and measurements: docs/cpu.md.
"""
from __future__ import annotations

import functools
import logging
import time
import types
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from tritonq.kernels import batch_invariant
from tritonq.kernels.cpu import dense as cpu_dense, native as cpu_native
from tritonq.kernels.common import ClampedSwiGLU
from tritonq.quant.packing import unpack_int32
from tritonq.quant.weights import DenseWeight, GGUFWeight, Int4Weight, MXFP4Weight, PartsWeight, Weight

log = logging.getLogger(__name__)

KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts, largest first
# _convert_weight_to_int4pack_for_cpu needs N % 16 == 0; with N % 64 == 0 its layout is one block form
# throughout (bytes [N / 64, K, 32]: low nibble row n0 + i, high nibble row n0 + 32 + i), the one that
# _dequantize_bf16 unpacks. N is padded with zero columns.
N_MULTIPLE = 64
DEQUANTIZE_ABOVE_M = 32  # without the template: rows above which dequantize + bf16 GEMM beats the kernel (docstring)
# Rows repacked per call at load. The packed layout groups rows in blocks of 32 (a 256-row slice packs
# to exactly its rows of the whole weight, checked in tests/kernels/cpu/test_cpu_lowbit.py); a slice's
# int32 temporaries are 2 x 256 x K x 4 bytes instead of 2 x N x K x 4 (8x the packed weight each).
PACK_ROWS = 256


@dataclass(frozen=True)
class CPUInt4Weight:
    """A 4-bit weight in torch's CPU int4 layout.

    packed        uint8 [N_pad, K_pad / 2] (from _convert_weight_to_int4pack_for_cpu; N_pad % 64 == 0)
    scales_zeros  bf16 [K_pad / group_size, N_pad, 2]: (scale, float zero), W = (q - 8) * scale + zero
    scales, zeros bf16 [K_pad / group_size, N_pad] each: the same, contiguous, for the dequantize path
                  (its fused loop runs ~4x faster than over the interleaved pairs; 1/16 of packed at g128)
    group_size    the kernel's group (one of KERNEL_GROUPS); may be smaller than the checkpoint's
    perm          int64 [K] or None: x[:, perm] is x in the permuted K order (act-order)
    bias          fp32 [N] or None
    Padded rows and columns have scale 0 and zero 0, so they contribute nothing.
    """
    packed: torch.Tensor
    scales_zeros: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    out_features: int
    in_features: int
    perm: torch.Tensor | None
    bias: torch.Tensor | None


@dataclass(frozen=True)
class CPUDenseWeight:
    """weight fp32 [N, K] (a view of [K, N]-contiguous storage), dequantized once; bias fp32 [N] or None."""
    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class CPUInt8Weight:
    """A symmetric 8-bit weight as its int8 codes, in cpu_native.int8_linear_weight's layout.

    codes   int8 [N_pad / 64, K, 64]: q - 128 (the signed level), a block of 64 output columns per stream
    scales  fp32 [N_pad / 64, K / group_size, 64] (the weight's scales widened: exact)
    W[n, k] = code * scale in fp32 (exact for fp16 / bf16 scales: GGUF's own d * q); padded columns are zero.
    bias    fp32 [N] or None
    """
    codes: torch.Tensor
    scales: torch.Tensor
    out_features: int
    bias: torch.Tensor | None


CPUWeight = CPUInt4Weight | CPUDenseWeight | CPUInt8Weight | GGUFWeight

_prepared: WeakIdKeyDictionary = WeakIdKeyDictionary()  # typed weight -> its CPUWeight (or tuple, stacked)


def prepare(w: Weight) -> CPUWeight:
    """The CPU form of a 2-D typed weight, built on the first call for this object and then reused (a weight that
    runs as it is, a GGUFWeight, is its own form: not kept here, where it would keep itself alive)."""
    p = _prepared.get(w)
    if p is None:
        p = _prepare(w)
        if p is not w:
            _prepared[w] = p
    return p


def prepare_experts(w: Weight) -> tuple[CPUWeight, ...]:
    """The CPU form of each expert of a stacked weight (leading dim E), built once per object."""
    p = _prepared.get(w)
    if p is None:
        # fused_moe_reference's dequantization: fp32, unrounded
        p = _prepared[w] = tuple(_prepare(w.expert(e), lambda e=e: w.expert(e).dequantize(torch.float32))
                                 for e in range(w.num_experts))
    return p


def linear(x: torch.Tensor, p: CPUWeight, compiled: bool = True) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W^T (+ bias) in x.dtype (see the module docstring for the numerics).

    compiled: above TEMPLATE_ABOVE_M rows a 4-bit weight may run inductor's int4 GEMM template, compiled for
    this weight on its first such call (`_template_gemm`); False keeps to the eager paths (MoE experts: one
    compile per expert would cost more than it saves)."""
    if isinstance(p, GGUFWeight):
        if torch.compiler.is_compiling():  # a compiled step: the C call as one opaque op
            return torch.ops.tritonq.cpu_gguf_linear(x, id(p))
        return _gguf_linear(x, p)
    if isinstance(p, CPUInt8Weight):
        if torch.compiler.is_compiling():  # a compiled step: the C call as one opaque op
            return torch.ops.tritonq.cpu_int8_linear(x, p.codes, p.scales, p.out_features, p.bias)
        return _int8_linear(x, p.codes, p.scales, p.out_features, p.bias)
    if isinstance(p, CPUDenseWeight):
        if batch_invariant():  # MKL's sums change with the row count: the C loop's (kernels/cpu/dense.py)
            y = cpu_native.small_linear(x.float().contiguous(), _rows_copy(p), p.weight.shape[0], p.bias,
                                        parallel=x.shape[0] * p.weight.numel() >= cpu_dense.PARALLEL_WORK)
            return y.to(x.dtype)
        return F.linear(x.float(), p.weight, p.bias).to(x.dtype)
    M, N = x.shape[0], p.out_features
    if M == 0:
        return x.new_zeros(0, N)
    xb = x.to(torch.bfloat16)
    if p.perm is not None:
        xb = xb[:, p.perm]
    pad = p.packed.shape[1] * 2 - p.in_features
    if pad:
        xb = F.pad(xb, (0, pad))
    if torch.compiler.is_compiling() and compiled and M > TEMPLATE_ABOVE_M:  # a compiled step's bucket (static M)
        y = torch.ops.tritonq.cpu_int4_matmul(xb.contiguous(), id(p))  # registered in _by_id by _prepare_int4
    else:
        y = _int4_matmul(xb.contiguous(), p, compiled)
    if y.shape[1] != N:
        y = y[:, :N]
    if p.bias is not None:
        y = y + p.bias  # bf16 + fp32 -> fp32: the bias is added unrounded
    return y.to(x.dtype).contiguous()


def _int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, N: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """CPUInt8Weight's linear: x as float32 rows through the C kernel, the result in x.dtype (rounded once)."""
    y = cpu_native.int8_linear(x.float().contiguous(), codes, scales, N, bias,
                               parallel=x.shape[0] * codes.numel() >= cpu_dense.PARALLEL_WORK)
    return y.to(x.dtype)


def _gguf_linear(x: torch.Tensor, p: GGUFWeight) -> torch.Tensor:
    """GGUFWeight's linear: x as float32 rows through the C kernel, the result in x.dtype (rounded once)."""
    y = cpu_native.gguf_linear(x.float().contiguous(), p,
                               parallel=x.shape[0] * p.lo.numel() * 8 >= cpu_dense.PARALLEL_WORK)
    return y.to(x.dtype)


_rows_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()  # CPUDenseWeight -> its copy for the C loop


def _rows_copy(p: CPUDenseWeight) -> torch.Tensor:
    """p's weight in cpu_native.small_linear_weight's layout (fp32), made on its first batch-invariant call."""
    copy = _rows_copies.get(p)
    if copy is None:
        copy = _rows_copies[p] = cpu_native.small_linear_weight(p.weight)
    return copy


def _int4_matmul(xb: torch.Tensor, p: CPUInt4Weight, compiled: bool = True) -> torch.Tensor:
    """[M, N_pad] bf16 = xb [M, K_pad] bf16 (contiguous, K permuted and padded) @ W^T by the path for M rows."""
    M = xb.shape[0]
    if batch_invariant():  # the eager kernel at every M: each row's sums in one order whatever the other rows
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p.packed, p.group_size, p.scales_zeros)
    template = _template_gemm(p) if M > TEMPLATE_ABOVE_M and compiled else None
    if template is not None:
        return template(xb)
    if M > DEQUANTIZE_ABOVE_M:
        if p in _uncompiled:
            return xb @ _unpack_dequantize_bf16(p.packed, p.scales, p.zeros, p.group_size)
        return xb @ _dequantize_bf16(p)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p.packed, p.group_size, p.scales_zeros)


# A compiled decode step (tritonq.engine.compiled) of more than TEMPLATE_ABOVE_M rows calls _int4_matmul as one
# opaque op, so that it runs the template, itself a compiled graph that the step's trace could not hold (its
# weight is frozen in); the op names the weight by an id into _by_id. Smaller buckets trace the int4 kernel
# itself: inductor then fuses the casts and padding around it (measured: the opaque op there cost the batch-1
# AWQ step 8.1 instead of 6.4 ms).
_by_id: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(CPUInt4Weight or GGUFWeight) -> it


_ops = torch.library.Library("tritonq", "FRAGMENT")
_ops.define("cpu_int4_matmul(Tensor xb, int weight) -> Tensor")
_ops.impl("cpu_int4_matmul", lambda xb, weight: _int4_matmul(xb, _by_id[weight]), "CPU")
_ops.impl("cpu_int4_matmul", lambda xb, weight: xb.new_empty(xb.shape[0], _by_id[weight].packed.shape[0]), "Meta")
_ops.define("cpu_int8_linear(Tensor x, Tensor codes, Tensor scales, int N, Tensor? bias) -> Tensor")
_ops.impl("cpu_int8_linear", _int8_linear, "CPU")
_ops.impl("cpu_int8_linear", lambda x, codes, scales, N, bias: x.new_empty(x.shape[0], N), "Meta")
_ops.define("cpu_gguf_linear(Tensor x, int weight) -> Tensor")  # the weight registered in _by_id by _prepare
_ops.impl("cpu_gguf_linear", lambda x, weight: _gguf_linear(x, _by_id[weight]), "CPU")
_ops.impl("cpu_gguf_linear", lambda x, weight: x.new_empty(x.shape[0], _by_id[weight].shape[0]), "Meta")


def fused_moe(x: torch.Tensor, gate_up: Weight, down: Weight, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: ClampedSwiGLU | None = None) -> torch.Tensor:
    """kernels.moe.fused_moe on CPU: each routed expert runs its MLP on its tokens through `linear`.

    x [T, D]; gate_up / down stacked typed weights [E, 2I, D] / [E, D, I] (stacked biases [E, N] are added
    by `linear`; gate_up a PartsWeight: its gate and up, each its own type); topk_* [T, k] -> [T, D] in x.dtype.
    activation None: SiLU-and-mul.
    """
    parts = [prepare_experts(p) for p in (gate_up.parts if isinstance(gate_up, PartsWeight) else (gate_up,))]
    down_e = prepare_experts(down)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():  # -1: another rank's expert (kernels.moe)
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = torch.cat([linear(x[token], p[e], compiled=False) for p in parts], dim=1).float().chunk(2, dim=1)
        hidden = F.silu(gate) * up if activation is None else activation.apply(gate, up)
        y = linear(hidden.to(x.dtype), down_e[e], compiled=False).float()
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    return out.to(x.dtype)


def _unpack_dequantize_bf16(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            group_size: int) -> torch.Tensor:
    """W^T [K_pad, N_pad] bf16 from CPUInt4Weight.packed [N_pad, K_pad / 2], scales and zeros
    [K_pad / group_size, N_pad]: W = (q - 8) * scale + zero in fp32, rounded once to bf16."""
    n_pad, k_pad = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(n_pad // 64, k_pad, 32).permute(1, 0, 2)  # [K, N / 64, 32]: rows n0 + i | n0 + 32 + i
    q = torch.cat((blocks & 15, blocks >> 4), dim=2).view(k_pad // group_size, group_size, n_pad).float()
    return ((q - 8) * scales[:, None].float() + zeros[:, None].float()).to(torch.bfloat16).view(k_pad, n_pad)


_dequantize_compiled = None


def _dequantize_bf16(p: CPUInt4Weight) -> torch.Tensor:
    """W^T [K_pad, N_pad] bf16 of p, by _unpack_dequantize_bf16 as one fused C++ loop (torch.compile, dynamic shapes: one compile per
    process, ~5-15 s, stated in the log; eager it is ~4x slower: six passes over the weight)."""
    global _dequantize_compiled
    if _dequantize_compiled is None:
        compiled = torch.compile(_unpack_dequantize_bf16, dynamic=True, fullgraph=True)
        start = time.perf_counter()
        w = compiled(p.packed, p.scales, p.zeros, p.group_size)
        log.info("CPU backend: int4 dequantize (prefill, M > %d) compiled in %.1f s", DEQUANTIZE_ABOVE_M,
                 time.perf_counter() - start)
        _dequantize_compiled = compiled
        return w
    return _dequantize_compiled(p.packed, p.scales, p.zeros, p.group_size)


TEMPLATE_ABOVE_M = 8  # rows above which inductor's int4 GEMM template beats the eager kernel (docstring)
TEMPLATE_GROUPS = (32, 64, 128)  # the groups its micro-kernels take; larger kernel groups are split
_templates: WeakIdKeyDictionary = WeakIdKeyDictionary()  # CPUInt4Weight -> its compiled GEMM, or None
_uncompiled: WeakIdKeyDictionary = WeakIdKeyDictionary()  # CPUInt4Weight -> True: never compile for it (settle_templates)
_template_failed = False  # set by the first failed compile: the others would fail the same way


class _Int4Matmul(torch.nn.Module):
    """x [M, K_pad] bf16 -> [M, N_pad] bf16 by _weight_int4pack_mm_for_cpu over one weight. The weight is held
    as buffers because inductor's freezing turns a module's buffers into constants, and its int4 GEMM template
    only takes a constant weight."""

    def __init__(self, p: CPUInt4Weight):
        super().__init__()
        split = p.group_size // min(p.group_size, TEMPLATE_GROUPS[-1])  # 256 -> two groups of 128, same values
        self.group_size = p.group_size // split
        self.register_buffer("packed", p.packed)
        self.register_buffer("scales_zeros", p.scales_zeros.repeat_interleave(split, dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_zeros)


def settle_templates(weights, compile: bool) -> None:
    """Decide, at load, how each 4-bit weight runs prefills (above TEMPLATE_ABOVE_M rows): compile its template
    now (a long-lived process, so that no request waits for a compile), or never compile anything for it (a
    one-shot command, whose prefill would not repay a compile: the eager kernel, and above DEQUANTIZE_ABOVE_M
    rows the dequantize loop run eagerly)."""
    for p in weights:
        if compile:
            if _template_gemm(p) is None and _dequantize_compiled is None:  # no template here: the path it runs
                _dequantize_bf16(p)
        elif p not in _templates:
            _templates[p] = None
            _uncompiled[p] = True


def _template_gemm(p: CPUInt4Weight):
    """p's GEMM compiled by torch.compile into inductor's C++ WoQ int4 template (AMX or AVX512 micro-kernels
    that unpack 4-bit tiles in registers: as fast as a bf16 GEMM above ~16 rows, where the eager kernel
    re-dequantizes the weight for every tile of rows), compiled on p's first call above TEMPLATE_ABOVE_M rows
    with the row count dynamic, so it never recompiles; None where the template cannot run (no AVX512, or the
    compile failed: said once in the log, and the eager paths run)."""
    global _template_failed
    if p in _templates:
        return _templates[p]
    if _template_failed:
        return None
    module = _Int4Matmul(p)
    # One code object per weight: dynamo keeps its compiled graphs per code object (a shared forward would
    # check every weight's guards on every call), and freezing bakes this weight into this graph.
    forward = _Int4Matmul.forward
    module.forward = types.MethodType(types.FunctionType(forward.__code__.replace(), forward.__globals__), module)
    compiled = torch.compile(module.forward, dynamic=False, fullgraph=True)
    # In force on every call, since any call may (re)compile; made once (building a patch costs ~12 us of the
    # ~28 us entering it on every call took). fx_graph_cache off: its key ignores the frozen constants'
    # values, so two weights of one shape would share the first one's graph, weights included.
    config = torch._inductor.config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP",
                                          fx_graph_cache=False)

    def gemm(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.mark_dynamic(x, 0)
        with config, torch.no_grad():
            return compiled(x)

    start = time.perf_counter()
    try:
        gemm(torch.zeros(TEMPLATE_ABOVE_M + 1, p.packed.shape[1] * 2, dtype=torch.bfloat16))
    except Exception as error:  # noqa: BLE001 - any compile failure leaves the eager paths, which always run
        _template_failed = True
        log.warning("CPU backend: inductor's int4 GEMM template did not compile (%s: %s); 4-bit linears above "
                    "%d rows dequantize to bf16 per call instead (slower prefill)", type(error).__name__,
                    str(error).splitlines()[0][:200], TEMPLATE_ABOVE_M)
        _templates[p] = None
        return None
    _note(f"4-bit linears above {TEMPLATE_ABOVE_M} rows run inductor's int4 GEMM template (torch.compile), "
          "compiled once per weight on its first use (~0.3 s a weight; a new shape ~1.5-4 s); each compiled "
          "weight keeps its own blocked copy besides the kernel's: 4-bit weights then take ~2-4x their packed "
          "bytes of host memory (still below bf16's 4x)")
    log.debug("CPU backend: int4 GEMM template for [%d, %d] compiled in %.2f s", p.out_features, p.in_features,
              time.perf_counter() - start)
    _templates[p] = gemm
    return gemm


# ----------------------------------------------------------------------------------------------
# Preparation (once per weight)
# ----------------------------------------------------------------------------------------------

def _prepare(w: Weight, dequantize=None) -> CPUWeight:
    """w's CPU form; dequantize() gives the fp32 W [N, K] of the reference this path must match
    (default w.dequantize(), int4_gemm's and fp8_gemm's)."""
    bias = None if w.bias is None else w.bias.float()
    if isinstance(w, DenseWeight):
        return CPUDenseWeight(w.weight.float(), bias)
    if isinstance(w, Int4Weight):
        w.check_g_idx()  # every g_idx entry names a scales row (what the reference checks per call)
    if isinstance(w, GGUFWeight) and cpu_native.library() is not None:
        _note("GGUF block-format weights (Q4_1 ... Q6_K, IQ4) stay in their planes as loaded and run the C "
              "library's GGUF linear (the gguf package's float32 values)")
        _by_id[id(w)] = w
        return w
    if (isinstance(w, Int4Weight) and w.bits == 8 and w.zeros is None and w.g_idx is None and w.perm is None
            and w.code is None and cpu_native.library() is not None):
        _note("symmetric 8-bit weights (GGUF Q8_0, GPTQ 8-bit sym) keep their int8 codes (1.125 bytes a weight at "
              "group 32) and run the C library's int8 linear")
        N, K = w.shape
        codes = torch.empty(K, N, dtype=torch.int8)
        for n0 in range(0, N, PACK_ROWS):  # a slice of columns at a time: the int32 temporaries stay small
            codes[:, n0:n0 + PACK_ROWS] = unpack_int32(w.qweight[:, n0:n0 + PACK_ROWS], 8, dim=0) - 128
        return CPUInt8Weight(*cpu_native.int8_linear_weight(codes, w.scales), N, bias)
    if isinstance(w, Int4Weight) and w.code is not None:
        reason = "bitsandbytes nf4/fp4 (a code table, not the integer levels torch's int4 kernel takes)"
    elif isinstance(w, Int4Weight) and w.bits == 4:
        p = _prepare_int4(w)
        if p is not None:
            _note("4-bit weights run torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu) with bf16 activations, "
                  "repacked once at load")
            return p
        reason = (f"4-bit group_size={w.group_size}{' with act-order' if w.g_idx is not None else ''} does not fit "
                  f"its groups of {KERNEL_GROUPS}")
    elif isinstance(w, Int4Weight):
        reason = "8-bit GPTQ with zeros or act-order, bitsandbytes LLM.int8() (or no C compiler)"
    elif isinstance(w, GGUFWeight):
        reason = "GGUF block formats without the C library (no C compiler)"
    elif isinstance(w, MXFP4Weight):
        reason = "MXFP4 (torch has no CPU fp4 GEMM)"
    else:
        reason = "FP8 (no CPU fp8 GEMM faster than fp32 dense: weight-only, activations not quantized, as below sm_89)"
    _note(f"{reason}: weights dequantized once at load to float32 (4 bytes a weight) and run as fp32 GEMMs")
    dense = (dequantize or w.dequantize)().float()
    return CPUDenseWeight(dense.t().contiguous().t(), bias)  # [K, N] storage: MKL's decode GEMV is faster


def _prepare_int4(w: Int4Weight) -> CPUInt4Weight | None:
    """torch's CPU int4 layout for w, or None when its groups cannot be cut into KERNEL_GROUPS."""
    N, K = w.shape
    group_of_row = w.g_idx.long() if w.g_idx is not None else torch.arange(K) // w.group_size
    perm = None
    if w.g_idx is not None:  # act-order: sort K by group once; x is gathered by perm per call
        perm = torch.argsort(group_of_row, stable=True)
        group_of_row = group_of_row[perm]
        if torch.equal(perm, torch.arange(K)):
            perm = None
    for kernel_group in KERNEL_GROUPS:  # largest kernel group that never straddles two of ours
        if K % kernel_group == 0 and bool((group_of_row.view(-1, kernel_group) == group_of_row[::kernel_group, None]).all()):
            break
    else:
        if not bool((group_of_row == group_of_row[0]).all()):
            return None
        kernel_group = KERNEL_GROUPS[-1]  # one group over all K (per-channel): pad K to whole groups
    K_pad = -(-K // kernel_group) * kernel_group
    N_pad = -(-N // N_MULTIPLE) * N_MULTIPLE
    packed = torch.empty(N_pad, K_pad // 2, dtype=torch.uint8)
    for n0 in range(0, N_pad, PACK_ROWS):  # a block of output rows at a time: int32 temporaries stay small
        n1 = min(n0 + PACK_ROWS, N_pad)
        q = unpack_int32(w.qweight[:, n0:min(n1, N)], 4, dim=0)  # [K, rows] in [0, 16)
        if perm is not None:
            q = q[perm]
        q_nk = torch.full((n1 - n0, K_pad), 8, dtype=torch.int32)
        q_nk[:q.shape[1], :K] = q.t()
        packed[n0:n1] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_nk, 1)  # innerKTiles: unused on CPU
    groups = F.pad(group_of_row, (0, K_pad - K), value=int(group_of_row[-1]))[::kernel_group]  # ours, per kernel group
    scales = w.scales.float()[groups]  # [K_pad / kernel_group, N]
    zeros = (8.0 - w.zeros.float()[groups]) * scales if w.zeros is not None else torch.zeros_like(scales)
    scales_zeros = torch.zeros(K_pad // kernel_group, N_pad, 2)
    scales_zeros[:, :N, 0], scales_zeros[:, :N, 1] = scales, zeros
    scales_zeros = scales_zeros.to(torch.bfloat16)
    p = CPUInt4Weight(
        packed=packed, scales_zeros=scales_zeros.contiguous(), scales=scales_zeros[..., 0].contiguous(),
        zeros=scales_zeros[..., 1].contiguous(), group_size=kernel_group,
        out_features=N, in_features=K, perm=perm, bias=None if w.bias is None else w.bias.float())
    _by_id[id(p)] = p
    return p


@functools.cache
def _note(message: str) -> None:
    """Say once per process which CPU path a kind of weight takes: a fact (info), nothing to act on. The
    message names the kind, never a layer's size, so each kind is said once."""
    log.info("CPU backend: %s", message)
