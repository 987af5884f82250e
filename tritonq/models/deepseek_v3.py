"""DeepSeek-V3 / R1 and the models built on its architecture (model_type deepseek_v3: Moonlight, Kimi K2).

DeepSeek-V2's model (tritonq.models.deepseek_v2: MLA in both attention modes, DeepSeekMoE with shared
experts, first_k_dense_replace dense layers) with V3's router:
  scores = sigmoid(x @ gate^T); experts are chosen by scores + e_score_correction_bias (the bias steers
  the choice only; the weights are the unbiased scores); n_group groups scored by the sum of their two best
  biased scores, the best topk_group kept; the top num_experts_per_tok weights are renormalized when
  norm_topk_prob and then ALWAYS multiplied by routed_scaling_factor (as DeepSeek's and transformers' code).
rope_interleave (default true, the published checkpoints): the rope dims are stored as interleaved pairs
(V2's layout); false: already half-split.

Multi-token prediction: checkpoints carry num_nextn_predict_layers extra decoder layers
(model.layers.<num_hidden_layers + i>.*: embed_tokens, enorm, hnorm, eh_proj, shared_head, a full layer)
that only a speculative MTP head reads. They are left unread, with one warning naming them, and do not
count as unused tensors (tritonq.formats.base.WeightsLoader.leave_unread).
"""
from __future__ import annotations

import re

import torch

from tritonq.models.deepseek_v2 import DeepseekV2ForCausalLM
from tritonq.models.moe import MoERouting


def deepseek_v3_routing(config) -> MoERouting:
    """MoERouting of V3's `noaux_tc` router; another topk_method / scoring_func in config.json is refused."""
    method, scoring = getattr(config, "topk_method", "noaux_tc"), getattr(config, "scoring_func", "sigmoid")
    if method != "noaux_tc" or scoring != "sigmoid":
        raise ValueError(f"DeepSeek-V3 topk_method={method!r}, scoring_func={scoring!r} are not supported; expected "
                         "'noaux_tc' with 'sigmoid' (V3's router; V2's softmax routers are model_type deepseek_v2)")
    top_k = config.num_experts_per_tok
    return MoERouting(top_k, "sigmoid", config.n_group, config.topk_group,
                      renormalize=bool(config.norm_topk_prob) and top_k > 1,
                      routed_scaling_factor=float(config.routed_scaling_factor), correction_bias=True)


def mtp_tensors(names: list[str], num_hidden_layers: int, num_mtp_layers: int) -> list[str]:
    """The stored names of the multi-token-prediction layers: model.layers.<L + i>.* for i < num_mtp_layers."""
    layers = {str(num_hidden_layers + i) for i in range(num_mtp_layers)}
    return [n for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n)) and m.group(1) in layers]


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """Built as DeepseekV2ForCausalLM is; see the module docstring."""
    routing = staticmethod(deepseek_v3_routing)

    @staticmethod
    def interleaved_rope(config) -> bool:
        return bool(getattr(config, "rope_interleave", True))

    def __init__(self, config, loader, dtype: torch.dtype, device: torch.device | str,
                 attention_mode: str | None = None, max_seq_len: int | None = None, expert_parallel: bool = False):
        num_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
        mtp = mtp_tensors(loader.weights.names(), config.num_hidden_layers, num_mtp)
        if mtp:
            loader.leave_unread(mtp, f"DeepSeek-V3 multi-token-prediction layer(s) (num_nextn_predict_layers="
                                     f"{num_mtp}): only a speculative MTP head reads them, which this runtime "
                                     "does not run")
        super().__init__(config, loader, dtype, device, attention_mode=attention_mode, max_seq_len=max_seq_len,
                         expert_parallel=expert_parallel)
