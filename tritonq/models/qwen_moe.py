"""Qwen3-MoE, Qwen2-MoE and Mixtral: the Llama decoder of tritonq.models.llama with a mixture-of-experts
block (tritonq.models.moe.SparseMoE) as the feed-forward of some or all layers.

  Qwen3-MoE  Qwen3's attention (q/k RMSNorm, attention_bias on q, k, v, o); num_experts routed experts of
             moe_intermediate_size, softmax top num_experts_per_tok, renormalized when norm_topk_prob; no
             shared expert. Layer i is MoE unless i is in mlp_only_layers, and only if (i + 1) is a multiple
             of decoder_sparse_step; the other layers run a dense MLP of intermediate_size. transformers'
             config keeps sliding_window only with use_sliding_window, and then every layer slides.
  Qwen2-MoE  Qwen2's attention (qkv_bias, default on; windows from layer_types), the same routing and layer
             rule, plus a shared expert (shared_expert_intermediate_size) scaled by
             sigmoid(x @ shared_expert_gate^T).
  Mixtral    Mistral's attention (a window on every layer when sliding_window is set); every layer is MoE:
             num_local_experts experts under `block_sparse_moe`, named w1 / w3 / w2 (gate / up / down),
             softmax top num_experts_per_tok, always renormalized.
Routing ties go to the lower expert index (grouped_topk); transformers' torch.topk promises no order.
Tensor parallel: attention as Llama's; every expert split by its intermediate size, Qwen2-MoE's shared expert
split like an MLP (its [1, D] sigmoid gate replicated: it scales each rank's partial sum alike), one
all-reduce per MoE layer (SparseMoE); or, expert_parallel=True, whole experts per rank (routing on every rank).
"""
from __future__ import annotations

from tritonq.models.common import MLP
from tritonq.models.llama import LlamaVariant, MistralForCausalLM, layer_windows
from tritonq.models.moe import MIXTRAL_NAMES, MoERouting, SparseMoE
from tritonq.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM


def _check_silu(config) -> None:
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"MoE experts support hidden_act='silu'; the config says {config.hidden_act!r}.")


def _qwen_moe_layer(config, layer: int) -> bool:
    """transformers' rule for Qwen2-MoE / Qwen3-MoE: MoE unless in mlp_only_layers, every decoder_sparse_step-th."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer + 1) % step == 0)


def _qwen_routing(config) -> MoERouting:
    return MoERouting(config.num_experts_per_tok, "softmax", renormalize=bool(config.norm_topk_prob))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (model_type qwen3_moe, e.g. Qwen3-30B-A3B); see the module docstring."""
    supports_tensor_parallel = True  # experts split by intermediate size (SparseMoE, one all-reduce)
    supports_expert_parallel = True  # or whole experts per rank
    supports_compile = False  # routing reads the chosen experts on the host

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        return LlamaVariant(qkv_bias=bias, o_bias=bias, qk_norm=True,
                            windows=layer_windows(config, [bool(window)] * config.num_hidden_layers))

    @classmethod
    def build_mlp(cls, config, loader, layer: int, variant: LlamaVariant, expert_parallel: bool = False):
        _check_silu(config)
        if not _qwen_moe_layer(config, layer):
            return None  # the dense LlamaMLP of intermediate_size
        return SparseMoE(loader, f"model.layers.{layer}.mlp", _qwen_routing(config), config.num_experts,
                         config.hidden_size, config.moe_intermediate_size, expert_parallel=expert_parallel)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2-MoE (model_type qwen2_moe, e.g. Qwen1.5-MoE-A2.7B); see the module docstring."""
    supports_tensor_parallel = True
    supports_expert_parallel = True
    supports_compile = False

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        return LlamaVariant(**{**vars(super().variant(config)), "qkv_bias": bool(getattr(config, "qkv_bias", True))})

    @classmethod
    def build_mlp(cls, config, loader, layer: int, variant: LlamaVariant, expert_parallel: bool = False):
        _check_silu(config)
        if not _qwen_moe_layer(config, layer):
            return None
        prefix, D = f"model.layers.{layer}.mlp", config.hidden_size
        shared = MLP(loader, f"{prefix}.shared_expert", D, config.shared_expert_intermediate_size, reduce=False)
        return SparseMoE(loader, prefix, _qwen_routing(config), config.num_experts, D, config.moe_intermediate_size,
                         shared=shared, shared_gate=True, expert_parallel=expert_parallel)


class MixtralForCausalLM(MistralForCausalLM):
    """Mixtral (model_type mixtral, e.g. Mixtral-8x7B); see the module docstring."""
    supports_tensor_parallel = True
    supports_expert_parallel = True
    supports_compile = False

    @classmethod
    def build_mlp(cls, config, loader, layer: int, variant: LlamaVariant, expert_parallel: bool = False):
        _check_silu(config)
        routing = MoERouting(config.num_experts_per_tok, "softmax", renormalize=True)
        return SparseMoE(loader, f"model.layers.{layer}.block_sparse_moe", routing, config.num_local_experts,
                         config.hidden_size, config.intermediate_size, names=MIXTRAL_NAMES,
                         expert_parallel=expert_parallel)
