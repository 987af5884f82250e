"""Mixture of experts: grouped top-k routing, token alignment, fused expert GEMM.

Routing `grouped_topk(router_logits [T, E])` -> (topk_weights [T, k] fp32, topk_ids [T, k] int32)
covers DeepSeek-V2 `greedy` / `group_limited_greedy` (softmax, group score = max in group) and
DeepSeek-V3 `noaux_tc` (sigmoid, correction bias for selection only, group score = sum of the
top-2 in group); ties go to the lower expert index (`routing.py`).

Expert MLP `fused_moe(x [T, D], gate_up [E, 2I, D], down [E, D, I], topk_weights, topk_ids)`
-> [T, D] in x.dtype = sum_k w_k * down_e(silu(gate_e x) * up_e x), gate rows first in gate_up.
Weights are stacked typed weights (tritonq/quant/weights.py, with a leading expert dim E):
  DenseWeight weight [E, N, K]; Int4Weight qweight [E, K*bits/32, N], scales/zeros [E, G, N],
  g_idx [E, K] or None; FP8Weight weight [E, N, K] fp8 with weight_scale [E] (per tensor),
  [E, N, 1] (per channel) or [E, ceil(N/bn), ceil(K/bk)] (block_size (bn, bk));
  MXFP4Weight blocks [E, N, K/32, 16] uint8 (two e2m1 codes a byte), scales [E, N, K/32] E8M0 (decoded
  in the kernel's tile load, `jit.py`); GGUFWeight planes [E, ...] (GGUF K-quants / IQ4: their own expert
  GEMM in kernels/gguf_gemm.py, launched through the same plan; Q4_K / Q4_1 up to 8 tokens on its decode word path,
  row blocks of the token count: `configs.gguf_word_config`). A gate_up PartsWeight (a gate and an up of different
  types, as some GGUF files hold them) runs one GEMM per part into [gate | up], then SiLU-and-mul.
A model's MoE layer builds a `MoEExperts(gate_up, down, activation)` once (the weights checked then, each T
bucket's launches resolved on its first call), routes with its `route(x, router_logits, top_k, ...)` (routing and
the token alignment for the layer's plan: one launch on the Triton backend, `route_tokens`) and calls it with
(x, topk_weights, topk_ids, alignment=); `fused_moe` is one call of a fresh one (aligning itself).
Shared experts are not part of this: the model runs them as an ordinary MLP and adds them.
gpt-oss experts: stacked biases (gate_up.bias [E, 2I], down.bias [E, D]; each added to its GEMM's
output before the activation / the routing weight, as transformers' GptOssExperts) and
`activation=ClampedSwiGLU(alpha, limit)` in place of SiLU-and-mul, fused in the same epilogue.
A topk_ids entry of -1 is a slot whose expert this process does not hold (expert parallelism, see
layers.RoutedExperts): it contributes zero, and no kernel computes it.
FP8 experts run W8A8 where the checkpoint quantizes activations and the GPU has e4m3 tensor cores (sm_89+),
else weight-only (`launch.py`). On CPU (no interpreter) each routed expert runs through
kernels/cpu/lowbit.py; `fused_moe_reference` (TRITONQ_BACKEND=torch) is the oracle.
Pipeline: `moe_align_block_size` sorts the T*k (token, slot) pairs by expert and pads each
expert's run to BLOCK_M, so each M block of rows belongs to one expert; `_moe_gemm_kernel`
then runs once for gate/up (two accumulators, SiLU-and-mul fused in the epilogue) and once
for down (routing weight multiplied in), each launch covering all experts; the down launch also sums
each token's k slots back into token order (slot order, its last row block per column tile:
`common.sum_expert_slots`).

Files, one job each: `routing.py` (grouped top-k, the token alignment, and both in one launch), `jit.py` (the @triton.jit expert
GEMM), `configs.py` (MoEConfig, defaults, how one is chosen and checked), `experts.py` (stacked-weight checks
and the W8A8 activation scheme, shared by launcher and reference), `launch.py` (fused_moe and one GEMM's
launch), `reference.py` (torch reference), `tune.py` (tuning declarations, meta experts, AOT launch). This
module re-exports their names.
"""
from tritonq.kernels.moe.configs import (DEFAULT_CONFIGS, GGUF_FEW_ROWS_CONFIG, WORD_DECODE_CONFIG, MoEConfig, _config,
                                        check_config, config_bucket, default_config)
from tritonq.kernels.moe.experts import fp8_activation_scheme
from tritonq.kernels.moe.jit import DENSE, FP8, INT4, MXFP4, _moe_gemm_kernel
from tritonq.kernels.moe.launch import FP8_DOT_MIN_K, MoEExperts, fp8_w8a8, fused_moe, moe_gemm_launch
from tritonq.kernels.moe.reference import fused_moe_reference
from tritonq.kernels.moe.routing import (align_launch, grouped_topk, grouped_topk_reference, moe_align_block_size,
                                         route_launch, route_tokens)
from tritonq.kernels.moe.tune import (CONFIG_SPACE, EXPERT_KINDS, TUNE_FORMAT, TUNE_GEMMS, aot_launch, meta_experts,
                                      sweep_space, tune_problem)
