"""GLM-4.5 / GLM-4.6 (model_type glm4_moe): the Llama decoder of tritonq.models.llama with DeepSeek-V3's router.

  attention  GQA with biases on q, k, v when attention_bias (o_proj never), an RMSNorm over each q and k head
             before rope when use_qk_norm, and partial rotary: rope (half-split, as Llama's) over the first
             head_dim * partial_rotary_factor dims of each head (0.5 in the released checkpoints), the rest unrotated.
  MoE        layers i >= first_k_dense_replace: n_routed_experts experts of moe_intermediate_size routed as
             DeepSeek-V3's `noaux_tc` (sigmoid scores, e_score_correction_bias steering the choice, n_group groups
             scored by their two best, topk_group kept; top num_experts_per_tok renormalized when norm_topk_prob,
             then times routed_scaling_factor), plus one shared MLP of n_shared_experts * moe_intermediate_size.
             The first first_k_dense_replace layers run a dense MLP of intermediate_size.
  MTP        num_nextn_predict_layers extra layers (model.layers.<num_hidden_layers + i>.*) feed only a speculative
             head: left unread with one warning, as DeepSeek-V3's (tritonq.models.deepseek_v3).
Tensor parallel as Qwen3-MoE (tritonq.models.qwen_moe): heads split by rank, experts by intermediate size or whole
experts per rank (expert_parallel), one all-reduce per MoE layer.
"""
from __future__ import annotations

import torch

from tritonq.models.common import MLP, RopeTables, rope_parameters
from tritonq.models.deepseek_v3 import mtp_tensors
from tritonq.models.llama import LlamaForCausalLM, LlamaVariant
from tritonq.models.moe import MoERouting, SparseMoE


def glm4_moe_routing(config) -> MoERouting:
    """The `noaux_tc` router (transformers' Glm4MoeTopkRouter renormalizes whenever norm_topk_prob)."""
    experts, groups = config.n_routed_experts, config.n_group
    if experts % groups or not 1 <= config.topk_group <= groups:
        raise ValueError(f"n_routed_experts={experts}, n_group={groups}, topk_group={config.topk_group}: the experts "
                         "must split into n_group equal groups and 1 <= topk_group <= n_group")
    return MoERouting(config.num_experts_per_tok, "sigmoid", groups, config.topk_group,
                      renormalize=bool(config.norm_topk_prob),
                      routed_scaling_factor=float(config.routed_scaling_factor), correction_bias=True)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 / 4.6 / 4.5-Air; see the module docstring."""
    supports_tensor_parallel = True
    supports_expert_parallel = True
    supports_compile = False  # routing reads the chosen experts on the host

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str, max_seq_len: int | None = None,
                 expert_parallel: bool = False):
        num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        mtp = mtp_tensors(loader.weights.names(), config.num_hidden_layers, num_mtp)
        if mtp:
            loader.leave_unread(mtp, f"GLM-4.5 multi-token-prediction layer(s) (num_nextn_predict_layers={num_mtp}): "
                                     "only a speculative MTP head reads them, which this runtime does not run")
        super().__init__(config, loader, dtype, device, max_seq_len=max_seq_len,
                         **({"expert_parallel": True} if expert_parallel else {}))

    @classmethod
    def variant(cls, config) -> LlamaVariant:
        factor = rope_parameters(config).get("partial_rotary_factor", 1.0)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = int(head_dim * factor)
        if not (0 < factor <= 1 and rotary % 2 == 0 and rotary > 0):
            raise ValueError(f"partial_rotary_factor={factor} with head_dim={head_dim} gives {rotary} rotary dims; "
                             "expected a factor in (0, 1] giving an even, positive number of dims")
        return LlamaVariant(qkv_bias=bool(getattr(config, "attention_bias", False)),
                            qk_norm=bool(getattr(config, "use_qk_norm", False)),
                            windows=(0,) * config.num_hidden_layers, partial_rotary=factor)

    @classmethod
    def build_mlp(cls, config, loader, layer: int, variant: LlamaVariant, expert_parallel: bool = False):
        if config.hidden_act != "silu":
            raise ValueError(f"GLM-4.5 MLPs and experts support hidden_act='silu'; the config says "
                             f"{config.hidden_act!r}.")
        if layer < config.first_k_dense_replace:
            return None  # the dense MLP of intermediate_size
        prefix, D, inter = f"model.layers.{layer}.mlp", config.hidden_size, config.moe_intermediate_size
        shared = (MLP(loader, f"{prefix}.shared_experts", D, inter * config.n_shared_experts, reduce=False)
                  if config.n_shared_experts else None)  # reduced with the routed experts, once
        return SparseMoE(loader, prefix, glm4_moe_routing(config), config.n_routed_experts, D, inter, shared=shared,
                         expert_parallel=expert_parallel)

    def rope_dim(self) -> int:
        return self.layers[0].self_attn.rotary_dim

    def position_tables(self, config, max_seq_len: int | None, dtype: torch.dtype) -> RopeTables:
        """Tables over the rotary dims only (partial_rotary_factor is consumed by the attention's split)."""
        rope = {k: v for k, v in rope_parameters(config).items() if k != "partial_rotary_factor"}
        return RopeTables(self.rope_dim(), rope["rope_theta"], rope, config.max_position_embeddings,
                          max_seq_len or config.max_position_embeddings, self.device, dtype)
