"""The stacked expert weights as the launcher and the torch reference both read them: fused_moe's checks
(`check_experts` once per layer, `check_moe_inputs` per call, `_check_moe` both) and the activation quantization
of a W8A8 GEMM over fp8 experts (`fp8_activation_scheme`)."""
from __future__ import annotations

import torch

from tritonq.quant.weights import WEIGHT_TYPES, FP8Weight, Weight


def _stacked_shape(w: Weight, name: str) -> tuple[int, int, int]:
    """(E, N, K) of a stacked weight, validating its fields have the leading expert dim."""
    if not isinstance(w, WEIGHT_TYPES):
        raise ValueError(f"fused_moe: {name} must be a stacked DenseWeight/Int4Weight/FP8Weight with a leading "
                         f"expert dim (loader.get_stacked), got {type(w).__name__}")
    E, N, K = w.stacked_shape(f"fused_moe: {name}")
    if w.bias is not None and (w.bias.shape != (E, N) or not w.bias.is_contiguous()):
        raise ValueError(f"fused_moe: {name} bias has shape {tuple(w.bias.shape)}; expected a contiguous [E={E}, "
                         f"N={N}] (one bias row per expert, as gpt-oss's gate_up_proj_bias / down_proj_bias)")
    return E, N, K


def check_experts(gate_up: Weight, down: Weight) -> tuple[int, int, int, torch.device]:
    """(E, I, D, device) of a layer's stacked experts gate_up [E, 2I, D] and down [E, D, I]; ValueError unless
    they have these shapes and all their tensors lie on one device."""
    E, two_i, D = _stacked_shape(gate_up, "gate_up")
    E2, down_n, inter = _stacked_shape(down, "down")
    if two_i != 2 * inter or down_n != D or E2 != E:
        raise ValueError(f"fused_moe: expected gate_up [E, 2I, D] and down [E, D, I], got gate_up [{E}, {two_i}, "
                         f"{D}] and down [{E2}, {down_n}, {inter}]")
    devices = {t.device for t in (*gate_up.tensors().values(), *down.tensors().values())}
    if len(devices) > 1:
        raise ValueError(f"fused_moe: the expert weights must be on one device, found {sorted(map(str, devices))}")
    return E, inter, D, devices.pop()


def check_moe_inputs(x, topk_weights, topk_ids, D: int, device: torch.device) -> None:
    """ValueError unless x [T, D] fp16/bf16/fp32 and topk_weights, topk_ids [T, k] lie on the experts' device."""
    if x.dim() != 2 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fused_moe: x must be [T, D] fp16/bf16/fp32, got {tuple(x.shape)} {x.dtype}")
    T = x.shape[0]
    if x.shape[1] != D:
        raise ValueError(f"fused_moe: x has D={x.shape[1]} columns but the experts are gate_up [E, 2I, D={D}] and "
                         f"down [E, D={D}, I]")
    if x.device != device or topk_weights.device != device or topk_ids.device != device:
        raise ValueError("fused_moe: x, routing and expert weights must be on one device, found x on "
                         f"{x.device}, topk_weights on {topk_weights.device}, topk_ids on {topk_ids.device} and "
                         f"the experts on {device}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: topk_weights and topk_ids must both be [T={T}, k], got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")


def _check_moe(x, gate_up, down, topk_weights, topk_ids) -> tuple[int, int, int]:
    """Both checks at once (the torch reference): (E, I, D)."""
    E, inter, D, device = check_experts(gate_up, down)
    check_moe_inputs(x, topk_weights, topk_ids, D, device)
    return E, inter, D


def fp8_activation_scheme(w: FP8Weight) -> tuple[int | None, torch.Tensor | None]:
    """(group_size, input_scale) for `quantize_activation_fp8` of a W8A8 GEMM's input over stacked fp8 experts w,
    as the checkpoint says: per 1 x bk group for block weights (block_size (bn, bk)), else per token (None);
    a static checkpoint's per-expert input_scale [E] becomes one scale, the largest (every expert's input stays
    in range; the input is quantized once, before the tokens are sorted by expert; as vLLM)."""
    group = w.block_size[1] if w.block_size is not None else None
    return group, None if w.input_scale is None else w.input_scale.float().max()
