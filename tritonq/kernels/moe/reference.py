"""The torch reference of fused_moe (float32 compute, a loop over experts): the test oracle and
TRITONQ_BACKEND=torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonq.kernels.common import ClampedSwiGLU
from tritonq.kernels.fp8_gemm import fp8_round_trip
from tritonq.kernels.moe.experts import _check_moe, fp8_activation_scheme
from tritonq.quant.weights import Weight


def fused_moe_reference(x: torch.Tensor, gate_up: Weight, down: Weight, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: ClampedSwiGLU | None = None,
                        w8a8: tuple[bool, bool] = (False, False)) -> torch.Tensor:
    """Loop over experts in float32: each expert runs its MLP (biases included) on the tokens routed to it.

    w8a8 (gate_up, down): that GEMM's input is rounded as the W8A8 kernel quantizes it (`fp8_activation_scheme`,
    `fp8_gemm.fp8_round_trip`; the hidden first rounded to x.dtype, the dtype the kernel stores it in)."""
    E, inter, D = _check_moe(x, gate_up, down, topk_weights, topk_ids)
    xf = fp8_round_trip(x, *fp8_activation_scheme(gate_up)) if w8a8[0] else x.float()
    out = torch.zeros(x.shape[0], D, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids[topk_ids >= 0]).tolist():  # -1: another rank's expert
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gu, dn = gate_up.expert(e), down.expert(e)
        gate, up = F.linear(xf[token], gu.dequantize(torch.float32), _float(gu.bias)).split(inter, dim=1)
        hidden = F.silu(gate) * up if activation is None else activation.apply(gate, up)
        if w8a8[1]:
            hidden = fp8_round_trip(hidden.to(x.dtype), *fp8_activation_scheme(down))
        y = F.linear(hidden, dn.dequantize(torch.float32), _float(dn.bias))
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    return out.to(x.dtype)


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()
