"""The mixture-of-experts block every MoE model builds: a router, routed experts run by one fused GEMM
pair (tritonq.kernels.moe.fused_moe), and optional always-on shared experts.

    x [T, D] -> router logits x @ router^T [T, E] (fp32) -> grouped_topk -> (weights [T, k], ids [T, k])
             -> fused_moe(x, gate_up [E, 2I, D], down [E, D, I]) (+ shared(x), optionally sigmoid-gated)
(on the Triton backend the routing and the experts' token alignment are one launch: MoEExperts.route)

How a model routes is data (`MoERouting`, read from its config by the model class), and so are its
expert tensor names (`ExpertNames`: Mixtral calls gate / up / down w1 / w3 / w2): the block itself has
one forward for every architecture. The per-expert linears are read by the checkpoint's loader (dense,
AWQ, GPTQ, fp8, compressed-tensors: whatever it stores) and stacked once, here at load, into the
fused-MoE layout (tritonq.quant.weights.stack_experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tritonq.distributed import all_reduce
from tritonq.formats.layers import RoutedExperts


@dataclass(frozen=True)
class MoERouting:
    """grouped_topk's arguments for one architecture: scoring "softmax" or "sigmoid"; experts split into
    n_group groups of which the best topk_group are kept (group score: the best expert, or with a
    correction bias the sum of the best two); renormalize the top_k weights to sum 1; then multiply them
    by routed_scaling_factor. correction_bias: the router stores `e_score_correction_bias` [E], added to
    the scores to choose experts but not to weigh them (DeepSeek-V3's aux-loss-free balancing)."""
    top_k: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False


@dataclass(frozen=True)
class ExpertNames:
    """Module names inside one expert (`<prefix>.experts.<e>.<name>`) and of the router."""
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    router: str = "gate"


MIXTRAL_NAMES = ExpertNames(gate="w1", up="w3", down="w2")


def _float32_tensor(loader, name: str, shape: tuple) -> torch.Tensor:
    """A router tensor in float32 whatever the compute dtype: the scores choose experts, and a bf16 rounding
    of the weights (or of V3's correction bias, ~1e-3 apart between experts) would change the choice."""
    loader.check_float(name)
    return loader.weights.get_tensor(name, shape=shape).to(device=loader.device, dtype=torch.float32)


def _router_weight(loader, prefix: str, shape: tuple[int, int]) -> torch.Tensor:
    """The router [E, D] in float32. Packers that quantize every linear (AutoAWQ's Qwen-MoE and DeepSeek models
    have no exclusion for it) store it quantized: it is then dequantized once, here."""
    if loader.is_quantized(prefix):
        return loader.get_linear(prefix, shape=shape).dequantize(torch.float32)
    return _float32_tensor(loader, f"{prefix}.weight", shape)


class SparseMoE(nn.Module):
    """Routed experts (+ shared experts) of one layer; see the module docstring.

    shared: an always-on MLP added to the routed output (DeepSeek's shared_experts, Qwen2-MoE's shared_expert: a
    tritonq.models.common.MLP with reduce=False), or None. shared_gate: the shared output is scaled by
    sigmoid(x @ <prefix>.shared_expert_gate.weight^T) ([1, D], Qwen2-MoE)."""

    def __init__(self, loader, prefix: str, routing: MoERouting, num_experts: int, hidden: int, inter: int,
                 names: ExpertNames = ExpertNames(), shared: nn.Module | None = None, shared_gate: bool = False,
                 expert_parallel: bool = False):
        super().__init__()
        self.routing = routing
        D = hidden
        self.router = _router_weight(loader, f"{prefix}.{names.router}", (num_experts, D))
        self.correction_bias = (_float32_tensor(loader, f"{prefix}.{names.router}.e_score_correction_bias",
                                                (num_experts,)) if routing.correction_bias else None)
        try:  # this rank's experts, stacked once, here: the fused-MoE layout [E, N, K] (layers.RoutedExperts)
            self.experts = RoutedExperts(loader.get_experts(prefix, num_experts, D, inter, expert_parallel,
                                                            (names.gate, names.up, names.down)))
        except ValueError as e:
            raise ValueError(f"{prefix}.experts: {e}") from e
        self.world = loader.world
        self.shared = shared
        self.shared_gate = (loader.get_tensor(f"{prefix}.shared_expert_gate.weight", shape=(1, D))
                            if shared_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        r = self.routing
        out = self.experts(  # this rank's part; with the shared part, reduced once
            x, x.float() @ self.router.T, top_k=r.top_k, n_group=r.n_group, topk_group=r.topk_group,
            scoring=r.scoring, correction_bias=self.correction_bias, renormalize=r.renormalize,
            routed_scaling_factor=r.routed_scaling_factor)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(x @ self.shared_gate.T) * shared
            out = out + shared
        return all_reduce(out) if self.world > 1 else out
