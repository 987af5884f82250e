"""Model building blocks. Linear runs its weight through `kernels.linear.LINEARS`, the one table of
linears by weight type (tritonq/quant/weights.py says what else a new type needs)."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tritonq.distributed import all_gather_last_dim, all_reduce
from tritonq.kernels.linear import Prepared, kind_of, prepare_gate_up
from tritonq.kernels.moe import MoEExperts
from tritonq.kernels.norm_rope import add_rms_norm, rms_norm, silu_mul  # noqa: F401 (models' MLPs take silu_mul from here)
from tritonq.quant.weights import DenseWeight, RankExperts, Weight, k_major


class Linear(nn.Module):
    """y = x @ W^T (+ bias) for x [..., K] -> [..., N]: the weight is checked and prepared once, here
    (`kernels.linear`: its GEMM object, its CPU form), and each call is the table row's run."""

    def __init__(self, weight: Weight, prepared: Prepared | None = None):
        """prepared: what the table row's prepare made of weight already (GateUpLinear's), else made here."""
        super().__init__()
        kind = kind_of(weight)
        if (isinstance(weight, DenseWeight) and k_major(weight.weight.device, weight.weight.dtype)
                and not weight.weight.t().is_contiguous()):
            # CPU fp32 runs W stored [K, N] (tritonq.quant.weights.k_major: faster decode GEMV). Loaders read weights
            # straight into that layout; anything else (a weight built by hand, a table tied to the head that
            # the loader did not know about) is re-laid out here, once.
            weight = replace(weight, weight=weight.weight.t().contiguous().t())
        # Held here, not looked up per call (a compiled step cannot look them up in the kernels' weak dicts)
        self.prepared, self.run = prepared or kind.prepare(weight), kind.run
        self.weight = self.prepared.weight  # the prepared form (an act-order int4 weight sorted once), held once
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x, self.prepared)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm.add_norm(residual, self(x)) for x [T, K]: (residual + x @ W^T, its RMSNorm), in the GEMM's launch
        where its kernel has that epilogue (a decode step's o_proj: `add_rms_norm` of Int4Gemm, FP8Gemm, Int8Gemm,
        DenseGemm), else the GEMM, then the norm's launch."""
        gemm = self.prepared.gemm  # a GEMM object, or a PartsWeight's list of parts
        fused = getattr(gemm, "HAS_ADD_NORM_EPILOGUE", False)
        out = gemm.add_rms_norm(x, residual, norm.weight, norm.eps) if fused else None
        return out if out is not None else norm.add_norm(residual, self(x))


class GateUpLinear(Linear):
    """SwiGLU's first half: x [..., K] -> silu(x @ gate^T) * (x @ up^T) [..., I] for the fused gate_up weight
    [2I, K] (gate rows, then up rows). One GEMM launch where its kernel has the activation as its epilogue
    (`kernels.linear.prepare_gate_up`), else the GEMM, then `silu_mul`. out_features is I."""

    def __init__(self, weight: Weight):
        gated = prepare_gate_up(weight)
        super().__init__(weight if gated is None else gated.weight, gated)
        self.fused = gated is not None
        self.out_features //= 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.run(x, self.prepared)
        return y if self.fused else silu_mul(y)


class _CollectiveLinear(Linear):
    """A Linear whose per-rank outputs are combined by `combine` (a collective) when world > 1."""

    combine = None  # staticmethod: [..., n] per rank -> the combined output

    def __init__(self, weight: Weight, world: int = 1):
        super().__init__(weight)
        self.world = world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.combine(y) if self.world > 1 else y


class RowParallelLinear(_CollectiveLinear):
    """Linear over this rank's K/world inputs: partial outputs [..., N] are summed across ranks
    (the bias lives on rank 0 only, see WeightsLoader). world 1 is a plain Linear."""

    combine = staticmethod(all_reduce)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """As Linear's; across ranks the sum comes first (the all-reduce), so the norm runs after it."""
        return super().add_norm(x, residual, norm) if self.world == 1 else norm.add_norm(residual, self(x))


class ParallelLMHead(_CollectiveLinear):
    """Output head over this rank's V/world vocabulary rows: logits [..., V/world] are gathered
    to [..., V] on every rank (rank r's rows come r-th). world 1 is a plain Linear."""

    combine = staticmethod(all_gather_last_dim)


class RoutedExperts(nn.Module):
    """The routed experts of one MoE layer that this rank holds (WeightsLoader.get_experts), run by fused_moe.

    forward(x [T, D], router_logits [T, E] fp32 over the E global experts, **routing: grouped_topk's arguments) ->
    [T, D]: this rank's part of the routed output, NOT summed over ranks: the MoE layer adds its shared experts'
    part and all-reduces once. Routing and the token alignment are one launch on the Triton backend
    (`MoEExperts.route`). Tensor parallel: every expert's I/world slice (partial sums of every slot). Expert
    parallel: experts [first, first + E/world) whole; slots routed elsewhere become -1 (fused_moe skips them).
    world 1: the whole output. The experts are checked once, here (`kernels.moe.MoEExperts`).
    """

    def __init__(self, experts: RankExperts):
        super().__init__()
        self.gate_up, self.down, self.first = experts.gate_up, experts.down, experts.first
        # checked once, launches resolved once per T bucket; only expert parallelism routes slots elsewhere (-1)
        self.fused = MoEExperts(self.gate_up, self.down)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, **routing) -> torch.Tensor:
        topk_weights, topk_ids, alignment = self.fused.route(x, router_logits, first_expert=self.first, **routing)
        return self.fused(x, topk_weights, topk_ids, alignment=alignment)


class Embedding(nn.Module):
    """token ids [...] int64 -> [..., D] rows of weight [V, D].

    Vocab-parallel when world > 1: weight holds rows [rank * V/world, (rank + 1) * V/world) of the
    full table; ids outside them give zeros here, and the sum over ranks is the full lookup.
    """

    def __init__(self, weight: torch.Tensor, rank: int = 0, world: int = 1):
        super().__init__()
        self.weight, self.world = weight, world
        self.vocab_start = rank * weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(rows * inside[..., None])


class RMSNorm(nn.Module):
    """x [..., D] -> normalized x * weight [D]; add_norm(x, h) -> (x + h, the norm of x + h), one pass on the CPU."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, h, self.weight, self.eps)


class LayerNorm(nn.Module):
    """x [..., D] -> (x - mean) / sqrt(var + eps) * weight [D] + bias [D] (bias None: none), as torch.nn.LayerNorm;
    torch's kernel accumulates the statistics in fp32 for 16-bit x (Falcon, MPT)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        super().__init__()
        self.weight, self.bias, self.eps = weight, bias, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
