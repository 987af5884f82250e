"""gpt-oss (OpenAI's gpt-oss-20b / 120b, model_type gpt_oss): the Llama decoder of tritonq.models.llama
with these differences, as transformers' GptOssForCausalLM runs them:

  attention  biases on q, k, v and o; a learned sink logit per query head (self_attn.sinks [H]) that
             joins every softmax denominator only (kernels/attention/jit.py); sliding window
             config.sliding_window (128) on the layers whose layer_types entry is "sliding_attention"
             (alternating, starting with layer 0), full attention on the others; yarn rope.
  MLP        a mixture of experts in every layer, no shared expert:
             router   logits = x @ router.weight^T + router.bias [T, E]; the top-k logits softmaxed
                      (`MoEExperts.route(renormalize=True)`: one launch with the experts' token alignment).
             experts  stored fused per layer: experts.gate_up_proj [E, D, 2I] with gate and up rows
                      interleaved (even = gate, odd = up), gate_up_proj_bias [E, 2I], down_proj [E, I, D],
                      down_proj_bias [E, D] (dense checkpoints), or their MXFP4 `_blocks` / `_scales`
                      (formats/mxfp4.py); the loader hands them over as [E, N, K] typed weights with the
                      gate rows first. Activation `ClampedSwiGLU(swiglu_alpha, swiglu_limit)`:
                      (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max=7), each expert's
                      output plus its down bias, times its routing weight.
Tensor parallel as Llama (heads; the sinks split with their heads) plus the experts: every rank holds
each expert's I/world slice (gate/up rows, down inputs: whole MXFP4 groups) and the MoE output is
all-reduced, the down bias added on rank 0 only; the router is replicated.
"""
from __future__ import annotations

import torch
from torch import nn

from tritonq.distributed import all_reduce
from tritonq.kernels.common import ClampedSwiGLU
from tritonq.kernels.moe import MoEExperts
from tritonq.models.llama import LlamaForCausalLM, LlamaVariant, layer_windows, sliding_layers_from_layer_types


class GptOssMoE(nn.Module):
    """Router (with bias) and routed experts of one layer; see the module docstring."""

    def __init__(self, config, loader, prefix: str, variant: LlamaVariant):
        super().__init__()
        E, D, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.top_k = config.num_experts_per_tok
        # The router in fp32: its top-k picks experts, and a bf16 near tie would flip between runs.
        self.router_weight = loader.get_tensor(f"{prefix}.router.weight", shape=(E, D)).float()
        self.router_bias = loader.get_tensor(f"{prefix}.router.bias", shape=(E,)).float()
        # Tensor parallel: each rank holds every expert's I/world slice (gate/up by output, down by input) and
        # the partial outputs are summed; the router is replicated.
        self.gate_up = loader.get_fused_experts(f"{prefix}.experts.gate_up_proj", (E, 2 * inter, D), interleaved=True,
                                                parallel="column")
        self.down = loader.get_fused_experts(f"{prefix}.experts.down_proj", (E, D, inter), parallel="row")
        self.activation = ClampedSwiGLU(float(config.swiglu_alpha), float(config.swiglu_limit))
        # checked once, launches resolved once per T bucket; every expert is here (tensor parallel), none dropped
        self.fused = MoEExperts(self.gate_up, self.down, self.activation)
        self.world = loader.world

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        logits = torch.addmm(self.router_bias, x.float(), self.router_weight.t())
        topk_weights, topk_ids, alignment = self.fused.route(x, logits, self.top_k, renormalize=True)
        out = self.fused(x, topk_weights, topk_ids, alignment=alignment)
        return all_reduce(out) if self.world > 1 else out


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (model_type gpt_oss); see the module docstring."""
    supports_tensor_parallel = True
    supports_compile = False  # MoE routing reads device values on the host (as DeepSeek-V2)

    @classmethod
    def build_mlp(cls, config, loader, layer: int, variant: LlamaVariant) -> nn.Module:
        return GptOssMoE(config, loader, f"model.layers.{layer}.mlp", variant)

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        if getattr(config, "hidden_act", "silu") != "silu":  # transformers ignores it: the clamped SwiGLU is fixed
            raise ValueError(f"gpt-oss: hidden_act={config.hidden_act!r}; expected 'silu' (the experts run the "
                             "clamped SwiGLU of swiglu_alpha / swiglu_limit)")
        bias = bool(getattr(config, "attention_bias", True))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, sinks=True,
                            windows=layer_windows(config, sliding_layers_from_layer_types(config)))
