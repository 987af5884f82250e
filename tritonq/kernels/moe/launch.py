"""Launchers: `MoEExperts`, one MoE layer's experts (checked once; `route`: routing + token alignment in one launch;
per call the input checks, the backend choice, the token alignment unless route's is given, and the two GEMM launches
resolved once per T bucket, the down GEMM summing each token's k slots itself), `fused_moe`
(one call of a fresh MoEExperts), and `moe_gemm_launch`, one GEMM's `Launch` over all experts (over meta tensors:
the launch tune --aot compiles).

FP8 experts run W8A8 where the checkpoint quantizes activations and the GPU has e4m3 tensor cores (sm_89+;
`fp8_w8a8`): each GEMM's input is quantized by fp8_gemm's `quantize_activation_fp8` per token (per-tensor /
per-channel weights), per 1 x 128 group (128 x 128 block weights) or with the static input_scale (the largest
over the experts), and the dot runs on e4m3 operands in fp32, scales applied after each K tile (block) or once
(per token x per channel). Weight-only otherwise (codes dequantized to x.dtype in-kernel): weight-only
checkpoints, below sm_89, and on the CPU backend / CPU torch reference.
On CPU (no interpreter) each routed expert runs through kernels/cpu/lowbit.py (its weights
prepared once, on the first call); TRITONQ_BACKEND=torch runs `fused_moe_reference` (`reference.py`).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton

from tritonq.kernels import backend
from tritonq.kernels.common import (
    MXFP4_FP16_MAX_SCALE,
    MXFP4_ONE_FACTOR_MAX_SCALE,
    ClampedSwiGLU,
    Launch,
    arrival_counts,
    config_rows,
    has_fp8_tensor_cores,
    int4_word_dequant,
    mxfp4_word_decode,
    next_pow2,
    on_gpu,
    slot_sum_args,
    upcast_dot,
)
from tritonq.kernels.cpu import lowbit as cpu_lowbit
from tritonq.kernels.fp8_gemm import quantize_activation_fp8
from tritonq.kernels.gguf_gemm import expert_word_dequant, gguf_moe_launch
from tritonq.kernels.moe.configs import GGUF_FEW_ROWS_CONFIG, MoEConfig, _config, check_config
from tritonq.kernels.moe.experts import check_experts, check_moe_inputs, fp8_activation_scheme
from tritonq.kernels.moe.jit import DENSE, FP8, INT4, MXFP4, _moe_gemm_kernel
from tritonq.kernels.moe.reference import fused_moe_reference
from tritonq.kernels.moe.routing import align_blocks, moe_align_block_size, route_tokens
from tritonq.kernels.norm_rope import silu_mul
from tritonq.quant.weights import DenseWeight, FP8Weight, GGUFWeight, Int4Weight, MXFP4Weight, PartsWeight, Weight

FP8_DOT_MIN_K = 32  # tl.dot's smallest K for e4m3 operands (Triton's min_dot_size for 8-bit types)


def _weight_args(w: Weight, native_fp8: bool, words: bool = False) -> dict:
    """Kernel arguments describing a stacked weight whose per-expert matrix is W [N, K]; words: MXFP4 blocks read
    as int32 words [E, N, K/8] (WORD_DEQUANT)."""
    if isinstance(w, DenseWeight):
        t = w.weight
        return dict(w_ptr=t, scale_ptr=t, zero_ptr=t, g_idx_ptr=t, stride_we=t.stride(0), stride_wn=t.stride(1),
                    stride_wk=t.stride(2), stride_se=0, stride_sn=0, stride_sk=0, group_size=1,
                    KIND=DENSE, BITS=4, HAS_ZEROS=False, HAS_G_IDX=False, SCALE_BN=1, SCALE_BK=1, FP8_AS_BITS=False)
    if isinstance(w, Int4Weight):
        q, s = w.qweight, w.scales
        return dict(w_ptr=q, scale_ptr=s, zero_ptr=s if w.zeros is None else w.zeros,
                    g_idx_ptr=q if w.g_idx is None else w.g_idx,
                    stride_we=q.stride(0), stride_wn=q.stride(2), stride_wk=q.stride(1),
                    stride_se=s.stride(0), stride_sn=s.stride(2), stride_sk=s.stride(1), group_size=w.group_size,
                    KIND=INT4, BITS=w.bits, HAS_ZEROS=w.zeros is not None, HAS_G_IDX=w.g_idx is not None,
                    SCALE_BN=1, SCALE_BK=1, FP8_AS_BITS=False)
    if isinstance(w, MXFP4Weight):
        b, s = (w.blocks.view(torch.int32).flatten(-2) if words else w.blocks), w.scales
        return dict(w_ptr=b, scale_ptr=s, zero_ptr=s, g_idx_ptr=s, stride_we=b.stride(0), stride_wn=b.stride(1),
                    stride_wk=1, stride_se=s.stride(0), stride_sn=s.stride(1), stride_sk=s.stride(2), group_size=32,
                    KIND=MXFP4, BITS=4, HAS_ZEROS=False, HAS_G_IDX=False, SCALE_BN=1, SCALE_BK=1, FP8_AS_BITS=False)
    t, s = w.weight, w.weight_scale.float()
    if w.block_size is not None:
        scale_bn, scale_bk = w.block_size
        strides = (s.stride(0), s.stride(1), s.stride(2))
    elif s.dim() == 1:  # per tensor: one scale per expert
        scale_bn, scale_bk, strides = 1, 1, (s.stride(0), 0, 0)
    else:  # per channel [E, N, 1]
        scale_bn, scale_bk, strides = 1, 1, (s.stride(0), s.stride(1), 0)
    return dict(w_ptr=t if native_fp8 else t.view(torch.uint8), scale_ptr=s, zero_ptr=s, g_idx_ptr=s,
                stride_we=t.stride(0), stride_wn=t.stride(1),
                stride_wk=t.stride(2), stride_se=strides[0], stride_sn=strides[1], stride_sk=strides[2],
                group_size=1, KIND=FP8, BITS=4, HAS_ZEROS=False, HAS_G_IDX=False,
                SCALE_BN=scale_bn, SCALE_BK=scale_bk, FP8_AS_BITS=not native_fp8)


def _gate_up_parts(gate_up: Weight, inter: int, activation: ClampedSwiGLU | None) -> tuple[Weight, ...]:
    """The weights of the gate/up GEMMs: gate_up itself, or a PartsWeight's gate and up experts [E, I, D] (of
    different types: GGUF files that quantize ffn_gate_exps and ffn_up_exps differently), run by SiLU-and-mul."""
    if not isinstance(gate_up, PartsWeight):
        return (gate_up,)
    shapes = [p.stacked_shape(f"fused_moe: gate_up part {i}")[1] for i, p in enumerate(gate_up.parts)]
    if shapes != [inter, inter] or activation is not None:
        raise ValueError(f"fused_moe: gate_up of typed parts must be a gate and an up part of I={inter} rows each run "
                         f"by SiLU-and-mul, got parts of {shapes} rows and activation {activation!r}; load the "
                         "experts through the format's loader (get_experts)")
    return gate_up.parts


def word_path(x: torch.Tensor, w: Weight, cc: int | None = None) -> bool:
    """Whether the GEMM over the stacked experts w for activations like x decodes its codes from 32-bit words (the
    kernel's WORD_DEQUANT: `common.int4_word_dequant` for int4, `common.mxfp4_word_decode` for MXFP4)."""
    return bool((isinstance(w, Int4Weight) and int4_word_dequant(x, w, cc))
                or (isinstance(w, MXFP4Weight) and mxfp4_word_decode(x, cc)))


def diagonal_path(x: torch.Tensor, w: Weight, tokens: int, cc: int | None = None) -> bool:
    """Whether GGUF experts w run gguf_gemm's decode word path for `tokens` tokens like x (`expert_word_dequant`,
    with `config_rows(tokens)` for the rows: no expert gets more; their tile: `configs.gguf_word_config`)."""
    return isinstance(w, GGUFWeight) and expert_word_dequant(x, w, config_rows(tokens), cc)


def fp8_w8a8(w: Weight, x: torch.Tensor) -> bool:
    """Whether fused_moe runs its GEMM over the stacked experts w as W8A8 (e4m3 activations x e4m3 codes) for
    activations like x: FP8 experts whose checkpoint quantizes activations (not w.weight_only, which e.g.
    compressed-tensors' `input_activations: null` sets), on a kernel with e4m3 tensor cores
    (`has_fp8_tensor_cores`: CUDA sm_89+, meta tensors (AOT), Triton's interpreter), and, for block weights, a
    K block that is a power of two >= FP8_DOT_MIN_K (real checkpoints: 128). Otherwise weight-only (codes
    dequantized to x.dtype in the kernel): below sm_89, and on the CPU backend and the CPU torch reference,
    which have no fp8 GEMM (as fp8_gemm's CPU path)."""
    if not isinstance(w, FP8Weight) or w.weight_only:
        return False
    if w.block_size is not None and (w.block_size[1] < FP8_DOT_MIN_K or w.block_size[1] & (w.block_size[1] - 1)):
        return False
    return (on_gpu(x) or backend(x) == "triton") and has_fp8_tensor_cores(x.device)


def _fit_block_k(config: MoEConfig, w: Weight, w8a8: bool) -> MoEConfig:
    """A default or tuned config with BLOCK_K narrowed to a W8A8 block weight's K block (a tile in one block)."""
    if w8a8 and w.block_size is not None and config.BLOCK_K > w.block_size[1]:
        return replace(config, BLOCK_K=w.block_size[1])
    return config


def fused_moe(x: torch.Tensor, gate_up: Weight, down: Weight, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoEConfig | tuple[MoEConfig, MoEConfig] | None = None,
              activation: ClampedSwiGLU | None = None, weight_only: bool | None = None) -> torch.Tensor:
    """x [T, D] -> [T, D] in x.dtype: sum_k topk_weights[:, k] * down_e(silu(gate_e x) * up_e x).

    Biases of the stacked weights (if any) are added to each GEMM's output; activation: None
    (SiLU-and-mul) or ClampedSwiGLU (gpt-oss).

    config: one MoEConfig for both GEMMs or a (gate_up, down) pair with equal BLOCK_M (the
    tuner's candidates); None: each GEMM's tuned config (`_config`), sharing the smaller BLOCK_M.
    FP8 experts: each GEMM runs W8A8 where `fp8_w8a8` says (its input quantized per token or per 1 x bk group,
    `fp8_activation_scheme`), else weight-only; weight_only=True forces weight-only (tests, benchmarks).
    One call of a `MoEExperts`, built here: a model's MoE layer builds its MoEExperts once and calls that.
    """
    return MoEExperts(gate_up, down, activation)(x, topk_weights, topk_ids, config, weight_only)


class MoEExperts:
    """fused_moe over one MoE layer's stacked experts, checked once here (shapes, one device, the activation).
    Per (T rounded up to a power of two, k, x dtype, path) the two GEMMs' configs, shared BLOCK_M and launch
    arguments are resolved once (`_MoEPlan`; the default config is the bucket's largest T's). `route` routes the
    router logits and aligns the tokens for that plan (one launch); a call checks x and the routing, takes route's
    alignment or aligns the tokens itself (no host read either way) and launches the two GEMMs (plus, for W8A8,
    each GEMM's activation quantization); the down GEMM writes the output itself, each token's k slots summed in
    slot order in its epilogue (`common.sum_expert_slots`): no zero fill, sum or cast around it. Routed slots of -1
    (experts another rank holds) add nothing; a token with no slot here gets a zero row."""

    def __init__(self, gate_up: Weight, down: Weight, activation: ClampedSwiGLU | None = None):
        self.E, self.inter, self.D, self.device = check_experts(gate_up, down)
        if activation is not None and not isinstance(activation, ClampedSwiGLU):
            raise ValueError(f"fused_moe: activation must be None (SiLU-and-mul) or a ClampedSwiGLU, "
                             f"got {activation!r}")
        self.gate_up, self.down, self.activation, self.plans = gate_up, down, activation, {}
        # the GEMMs' weights: gate/up (one fused GEMM), or its gate and up of different types (one GEMM each into the
        # two halves of one output, then SiLU-and-mul), and down
        self.weights = (*_gate_up_parts(gate_up, self.inter, activation), down)
        # MXFP4: the largest E8M0 exponent of each GEMM's experts, read once (it picks the word path's multiplies)
        self.max_scales = tuple(int(w.scales.max()) if isinstance(w, MXFP4Weight) and not w.scales.is_meta else None
                                for w in self.weights)

    def route(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, first_expert: int = 0,
              **routing) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """routing.route_tokens for a call on x: (topk_weights, topk_ids of these experts, global ids from
        first_expert; the alignment of this layer's plan for x, or None where no Triton GEMM runs), to pass to
        __call__ (alignment=). routing: grouped_topk's other arguments. On the Triton backend one launch."""
        T = router_logits.shape[0]
        block_m = None
        if backend(x) == "triton" and T > 0:
            block_m = self._plan_for(x, T, top_k, None, None).block_m
        return route_tokens(router_logits, top_k, **routing, block_m=block_m, num_experts=self.E,
                            first_expert=first_expert)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 config: MoEConfig | tuple[MoEConfig, MoEConfig] | None = None,
                 weight_only: bool | None = None, alignment: tuple | None = None) -> torch.Tensor:
        """alignment: `route`'s, for topk_ids and this call's plan (the default config, weight_only None), so the
        tokens are not aligned again; None: aligned here."""
        gate_up, down, E, D = self.gate_up, self.down, self.E, self.D
        check_moe_inputs(x, topk_weights, topk_ids, D, self.device)
        explicit = check_config(config) if config is not None else None
        if weight_only not in (None, True):
            raise ValueError(f"fused_moe: weight_only must be None (W8A8 where `fp8_w8a8` says) or True, "
                             f"got {weight_only!r}")
        b = backend(x)
        if alignment is not None and (b != "triton" or explicit is not None or weight_only):
            raise ValueError("fused_moe: a precomputed alignment is for the Triton backend's default plan (MoEExperts."
                             f"route); this call runs backend {b!r}, config {config!r}, weight_only {weight_only!r}: "
                             "pass alignment=None")
        if b == "cpu":  # per expert, torch's CPU kernels over weights prepared once (kernels/cpu/lowbit.py)
            return cpu_lowbit.fused_moe(x, gate_up, down, topk_weights, topk_ids, self.activation)
        T, top_k = topk_ids.shape
        if b == "torch":
            w8a8 = (False, False) if weight_only else (fp8_w8a8(gate_up, x), fp8_w8a8(down, x))
            return fused_moe_reference(x, gate_up, down, topk_weights, topk_ids, self.activation, w8a8)
        if T == 0:
            return x.new_zeros(T, D)
        plan = self._plan_for(x, T, top_k, weight_only, explicit)
        x = x.contiguous()
        numel, block_m = T * top_k, plan.block_m
        # Slots of other ranks' experts (-1) sort last, past num_tokens_post_padded, where the kernels stop: those
        # rows stay zero. No host read.
        if alignment is None:
            alignment = moe_align_block_size(topk_ids, block_m, E)
        else:
            _check_alignment(alignment, numel, block_m, E, x.device)
        sorted_ids, expert_ids, post_padded = alignment
        routing = topk_weights.float().contiguous().flatten()
        slot_rows = torch.empty(numel, D, dtype=x.dtype, device=x.device)  # (token, slot) rows x routing weight
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)  # every row written by the down GEMM's slot sum
        bound = dict(routing_weight_ptr=routing, sorted_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids,
                     num_tokens_post_padded_ptr=post_padded, num_valid=numel)
        # W8A8: each GEMM's input quantized once, row by row (x per token; hidden per (token, slot) row)
        if len(self.weights) == 3:  # gate and up of different types: their GEMMs into one [gate | up], then the SwiGLU
            both = torch.empty(numel, 2 * self.inter, dtype=x.dtype, device=x.device)
            plan.run(0, x, both[:, :self.inter], expert_ids, bound)
            plan.run(1, x, both[:, self.inter:], expert_ids, bound)
            hidden = silu_mul(both)
        else:
            hidden = torch.empty(numel, self.inter, dtype=x.dtype, device=x.device)
            plan.run(0, x, hidden, expert_ids, bound)
        plan.run(len(self.weights) - 1, hidden, slot_rows, expert_ids,
                 bound | dict(sum_ptr=out, topk_ids_ptr=topk_ids.contiguous()))
        return out

    def _plan_for(self, x: torch.Tensor, T: int, top_k: int, weight_only: bool | None,
                  explicit: tuple[MoEConfig, MoEConfig] | None) -> _MoEPlan:
        """The plan of T tokens' bucket (made on its first call), or a fresh one for an explicit config."""
        key = (next_pow2(T), top_k, x.dtype, bool(weight_only))
        plan = self.plans.get(key) if explicit is None else None
        if plan is None:
            plan = self._plan(x, key[0], top_k, weight_only, explicit)
            if explicit is None:
                self.plans[key] = plan
        return plan

    def _plan(self, x: torch.Tensor, tokens: int, top_k: int, weight_only: bool | None,
              explicit: tuple[MoEConfig, MoEConfig] | None) -> _MoEPlan:
        """The GEMMs' launches (gate/up or its parts, then down) for up to `tokens` tokens of x's dtype, routed to
        top_k experts each; an explicit (gate_up, down) config pair gives the parts the first."""
        E, inter, D, parts = self.E, self.inter, self.D, len(self.weights) > 2
        shapes = [(D, inter)] * (len(self.weights) - 1) + [(inter, D)]  # each GEMM's (K, N)
        w8a8 = [not weight_only and fp8_w8a8(w, x) for w in self.weights]
        configs = [explicit[w is self.down] if explicit else _fit_block_k(
            _config(tokens, top_k, E, N, K, word_path(x, w), diagonal_path(x, w, tokens)), w, quantized)
            for w, (K, N), quantized in zip(self.weights, shapes, w8a8)]
        # All GEMMs share one alignment, so they use the smallest BLOCK_M of the configs; a GGUF GEMM whose default
        # has more rows (fp32 weights beside the decode word path) takes the few-rows tile
        block_m = min(cfg.BLOCK_M for cfg in configs)
        if not explicit:
            configs = [replace(GGUF_FEW_ROWS_CONFIG, BLOCK_M=block_m)
                       if isinstance(w, GGUFWeight) and cfg.BLOCK_M > block_m else cfg
                       for w, cfg in zip(self.weights, configs)]
        native_fp8 = has_fp8_tensor_cores(x.device)

        def stand_in(*shape, dtype=x.dtype):  # the dtypes of what each call binds (shapes and strides: per call)
            return torch.empty(shape, dtype=dtype, device=x.device)
        alignment = (stand_in(1, dtype=torch.int32),) * 3
        gemms = []
        for weight, cfg, quantized, (K, N), max_scale in zip(self.weights, configs, w8a8, shapes, self.max_scales):
            gate, part = weight is self.gate_up, parts and weight is not self.down
            scheme = fp8_activation_scheme(weight) if quantized else None
            if quantized:
                group, static = scheme
                a = stand_in(1, K, dtype=torch.float8_e4m3fn)
                a_scale = stand_in(*(() if static is not None else (1, -(K // -(group or K)))), dtype=torch.float32)
            else:
                a, a_scale = stand_in(1, K), None
            # down: the slot sum's output and ids per call, its arrival counts the plan's (made once, here)
            slot_sum = None if weight is not self.down else (stand_in(1, D), stand_in(1, top_k, dtype=torch.int32),
                                                             arrival_counts(-(N // -cfg.BLOCK_N), x.device))
            launch = moe_gemm_launch(a, stand_in(1, N), weight, stand_in(1, dtype=torch.float32), alignment, top_k,
                                     cfg, block_m, gate, native_fp8, self.activation if gate else None, a_scale,
                                     mxfp4_max_scale=max_scale, slot_sum=slot_sum, part=part)
            for name in _PER_CALL + (() if slot_sum is None else _PER_CALL_SUM):
                del launch.args[name]
            gemms.append((launch, scheme, launch.grid[1]))
        return _MoEPlan(block_m, gemms)


# what a call binds to a plan's GEMM launches: activations, output, routing, alignment and the activation scales
_PER_CALL = ("a_ptr", "out_ptr", "routing_weight_ptr", "sorted_ids_ptr", "expert_ids_ptr",
             "num_tokens_post_padded_ptr", "num_valid", "stride_am", "stride_om", "a_scale_ptr", "stride_asm",
             "stride_asg")
_PER_CALL_SUM = ("sum_ptr", "topk_ids_ptr")  # and what a call binds to the down GEMM's slot sum


class _MoEPlan:
    """The GEMM launches of a MoEExperts bucket (gate/up, or its gate and up parts, then down), their shared BLOCK_M,
    and each GEMM's W8A8 activation scheme (`fp8_activation_scheme`, None: unquantized input) and column tiles."""

    def __init__(self, block_m: int, gemms: list):
        self.block_m, self.gemms = block_m, gemms

    def run(self, i: int, a: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor, bound: dict) -> None:
        """Launch GEMM i (`MoEExperts.weights`' order) over a into out with the call's routing and alignment
        `bound`."""
        launch, scheme, tiles_n = self.gemms[i]
        if scheme is None:
            a_scale, strides = bound["routing_weight_ptr"], (0, 0)  # unused
        else:
            a, a_scale = quantize_activation_fp8(a, *scheme)
            strides = (0, 0) if a_scale.dim() == 0 else a_scale.stride()
        launch((expert_ids.numel(), tiles_n), a_ptr=a, out_ptr=out, stride_am=a.stride(0), stride_om=out.stride(0),
               a_scale_ptr=a_scale, stride_asm=strides[0], stride_asg=strides[1], **bound)


def moe_gemm_launch(a: torch.Tensor, out: torch.Tensor, weight: Weight, routing: torch.Tensor, alignment: tuple,
                    top_k: int, config: MoEConfig, block_m: int, gate_up: bool, native_fp8: bool,
                    activation: ClampedSwiGLU | None = None, a_scale: torch.Tensor | None = None,
                    cc: int | None = None, mxfp4_max_scale: int | None = None,
                    slot_sum: tuple | None = None, part: bool = False) -> Launch:
    """The launch of _moe_gemm_kernel for one of the two GEMMs, over all experts.

    gate_up: a = x [T, D], weight [E, 2I, D], out = hidden [T*k, I] (SiLU-and-mul fused); else
    a = hidden [T*k, I], weight [E, D, I], out [T*k, D] times the routing weights [T*k] fp32, and slot_sum
    (sum [T, D] in out's dtype, topk_ids [T, k], arrivals: one int32 zero per column tile, `common.arrival_counts`):
    the launch also writes sum, each token's k rows of out added in slot order (`common.sum_expert_slots`).
    part (the gate or the up GEMM of experts whose gate and up differ in type, `MoEExperts`): a = x [T, D], weight
    [E, I, D], out [T*k, I] (a view: one half of [gate | up]) = the tokens' rows @ W^T, no activation or routing weight.
    alignment: (sorted_ids, expert_ids, num_tokens_post_padded) of `moe_align_block_size(.., block_m)`.
    native_fp8: load fp8 weights as float8e4nv (`has_fp8_tensor_cores`), else decode their bytes.
    weight.bias [E, N_w] (if any) is added to the GEMM output; activation (gate_up only): ClampedSwiGLU or
    None (SiLU-and-mul). Over meta tensors this is the launch tune --aot compiles.
    a_scale (W8A8, fp8 experts with fp8 tensor cores): a is e4m3 from `fp8_gemm.quantize_activation_fp8` and
    a_scale its fp32 scales ([rows, 1] per token, [rows, ceil(K/bk)] per 1 x bk group for block weights, []
    static); the weight's codes are loaded as e4m3 (native_fp8 must be True) and the dot runs in e4m3.
    cc: the target of meta tensors (`common.int4_word_dequant`, `common.mxfp4_word_decode`).
    mxfp4_max_scale: the largest E8M0 exponent of MXFP4 experts (`MoEExperts` reads it once), which picks the word
    path's scale factors (`_mxfp4_steps`); None: read here (a host sync), or for meta experts taken as at most
    MXFP4_ONE_FACTOR_MAX_SCALE.
    """
    if (gate_up or part) == (slot_sum is not None) or (gate_up and part):
        raise ValueError(f"fused_moe: slot_sum (the down GEMM's sum over the k slots) goes with the down GEMM only, "
                         f"part with a GEMM that is neither; got gate_up={gate_up}, part={part} and slot_sum "
                         f"{'given' if slot_sum is not None else 'None'}")
    if isinstance(weight, GGUFWeight):  # GGUF block formats: their own expert kernel, in the GGUF kernel family
        return gguf_moe_launch(a, out, weight, routing, alignment, top_k, config, block_m, gate_up, activation,
                               slot_sum, cc, part)
    sorted_ids, expert_ids, post_padded = alignment
    N, K = out.shape[1], a.shape[1]
    if isinstance(weight, MXFP4Weight) and config.BLOCK_K % 32:
        raise ValueError(f"fused_moe: BLOCK_K={config.BLOCK_K} with MXFP4 experts; it must be a multiple of the "
                         "32-element scale group (use 32, 64 or 128)")
    words = word_path(a, weight, cc)
    w8a8 = a_scale is not None
    if w8a8:
        _check_w8a8_launch(a, weight, config, native_fp8)
    mxfp4_steps = 2
    if isinstance(weight, MXFP4Weight) and words:
        if mxfp4_max_scale is None and not weight.scales.is_meta:
            mxfp4_max_scale = int(weight.scales.max())
        mxfp4_steps = _mxfp4_steps(a.dtype, mxfp4_max_scale)
    tile_scale_row = weight.scales_constant_over(config.BLOCK_K)
    block_scaled = w8a8 and weight.block_size is not None
    a_scale_strides = (0, 0) if not w8a8 or a_scale.dim() == 0 else a_scale.stride()
    args = dict(a_ptr=a, out_ptr=out, routing_weight_ptr=routing, sorted_ids_ptr=sorted_ids,
                expert_ids_ptr=expert_ids, num_tokens_post_padded_ptr=post_padded,
                num_valid=routing.numel(), N=N, K=K, up_offset=N if gate_up else K,  # the I of gate_up
                a_row_divisor=top_k if gate_up or part else 1, stride_am=a.stride(0), stride_om=out.stride(0),
                GATE_UP=gate_up, PART=part, TILE_SCALE_ROW=tile_scale_row, UPCAST_DOT=upcast_dot(a),
                BLOCK_M=block_m, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K,
                **_weight_args(weight, native_fp8, words), WORD_DEQUANT=words,
                bias_ptr=routing if weight.bias is None else weight.bias,
                stride_be=0 if weight.bias is None else weight.bias.stride(0),
                swiglu_alpha=activation.alpha if activation else 1.0, swiglu_limit=activation.limit if activation else 0.0,
                HAS_BIAS=weight.bias is not None, CLAMPED_SWIGLU=activation is not None,
                a_scale_ptr=a_scale if w8a8 else routing, stride_asm=a_scale_strides[0], stride_asg=a_scale_strides[1],
                A_GROUP=weight.block_size[1] if block_scaled else K, A_FP8=w8a8, SCALE_PER_TILE=block_scaled,
                ONE_W_SCALE=block_scaled and weight.block_size[0] % config.BLOCK_N == 0
                and (not gate_up or N % weight.block_size[0] == 0),
                MASK_K=K % config.BLOCK_K != 0, MASK_N=N % config.BLOCK_N != 0,
                SCALE_AFTER_DOT=bool(words) and isinstance(weight, Int4Weight) and tile_scale_row
                and block_m < config.BLOCK_K, MXFP4_STEPS=mxfp4_steps,
                **slot_sum_args(slot_sum, top_k))
    grid = (expert_ids.numel(), triton.cdiv(N, config.BLOCK_N))
    return Launch(_moe_gemm_kernel, grid, args, config.num_warps, config.num_stages)


def _check_alignment(alignment: tuple, numel: int, block_m: int, num_experts: int, device: torch.device) -> None:
    """A precomputed alignment is moe_align_block_size's triple for numel pairs at the plan's block_m (its block
    count and rows pin block_m) on the experts' device."""
    blocks = align_blocks(numel, block_m, num_experts)
    shapes = tuple(tuple(t.shape) for t in alignment) if len(alignment) == 3 else None
    if (shapes != ((blocks * block_m,), (blocks,), (1,)) or any(t.dtype != torch.int32 or t.device != device
                                                                for t in alignment)):
        raise ValueError(f"fused_moe: alignment must be int32 tensors of shapes ({blocks * block_m},), ({blocks},), "
                         f"(1,) on {device} (MoEExperts.route for these {numel} pairs, block_m {block_m}), got "
                         f"{[(tuple(t.shape), t.dtype, str(t.device)) for t in alignment]}; pass route's alignment "
                         "or None")


def _mxfp4_steps(dtype: torch.dtype, max_scale: int | None) -> int:
    """The packed multiplies per two codes of `common.mxfp4_words_to_half` for MXFP4 experts whose largest E8M0
    exponent is max_scale: one up to 2^1 (MXFP4_ONE_FACTOR_MAX_SCALE), else two; ValueError for fp16 past
    MXFP4_FP16_MAX_SCALE, where every nonzero weight of the group would overflow fp16."""
    if max_scale is None or max_scale <= MXFP4_ONE_FACTOR_MAX_SCALE:
        return 1
    if dtype == torch.float16 and max_scale > MXFP4_FP16_MAX_SCALE:
        raise ValueError(f"fused_moe: MXFP4 experts with a scale of 2^{max_scale - 127} (E8M0 exponent {max_scale}) in "
                         f"fp16, which holds the products of scales up to 2^{MXFP4_FP16_MAX_SCALE - 127} only (its "
                         "largest value is 65504); run the model in bfloat16")
    return 2


def _check_w8a8_launch(a: torch.Tensor, weight: Weight, config: MoEConfig, native_fp8: bool) -> None:
    if not isinstance(weight, FP8Weight) or a.dtype != torch.float8_e4m3fn or not native_fp8:
        raise ValueError(f"fused_moe: W8A8 (a_scale given) needs FP8 experts, float8_e4m3fn activations and fp8 "
                         f"tensor cores (native_fp8), got {type(weight).__name__}, {a.dtype}, native_fp8={native_fp8}")
    if config.BLOCK_K < FP8_DOT_MIN_K or (weight.block_size is not None and weight.block_size[1] % config.BLOCK_K):
        raise ValueError(f"fused_moe: BLOCK_K={config.BLOCK_K} with W8A8 fp8 experts (block_size {weight.block_size}); "
                         f"it must be >= {FP8_DOT_MIN_K} (tl.dot's smallest e4m3 K) and divide the weight's K block, so "
                         "that a K tile lies inside one scale block")
