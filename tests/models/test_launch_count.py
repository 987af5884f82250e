"""Kernel launches per decoder layer in one decode step, counted on a fake GPU: tiny Llama / Qwen3 / DeepSeek-V2 /
gpt-oss checkpoints built on the `meta` device (no data), their Triton launches recorded instead of run (as
tests/fake_gpu.py does) and every torch op that would launch a CUDA kernel counted (a TorchDispatchMode over the aten
ops, leaving out views and allocations, which launch nothing). A layer's count is the difference between a model of
3 and one of 2 layers, so the embedding, rope gather, final norm and lm_head are not in it.

Each architecture is counted with dense bf16 weights (a plain linear: one cuBLAS launch; gate_up and o_proj at decode:
the Triton dense GEMM with the SwiGLU / residual + RMSNorm epilogue) and Llama / Qwen3 also with a 4-bit GPTQ
checkpoint (int4_gemm, one launch a linear, epilogues alike), Llama with fp8 (per tensor, per channel) and W8A8 int8
ones (fp8_gemm, int8_gemm: the activations quantized inside the GEMM, epilogues alike). The step counted is the
second one: the first makes each GEMM's plan and its arrival counts, once, as the engine's warm-up does. The context
is one page (16 tokens), which decode attention reads in one KV split: one launch, the merge folded in (on a GPU,
batch x kv heads that fill the SMs do the same; a longer context at a small batch adds the merge: one more).
"""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

from tritonq.formats.registry import get_loader
from tritonq.models import model_class
from tritonq.models.common import StepContext

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach", "alias",
             "set_", "resize_"}


class OpCount(TorchDispatchMode):
    """Counts the aten ops that launch a kernel on CUDA (views and allocations do not)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[1]
        if not func.is_view and name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def tiny(arch: str, layers: int):
    """A tiny random transformers config of arch with `layers` decoder layers."""
    from transformers import DeepseekV2Config, GptOssConfig, LlamaConfig, Qwen3Config
    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None,
                  eos_token_id=None, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=16)
    if arch == "gpt_oss":
        return GptOssConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    return DeepseekV2Config(**{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, kv_lora_rank=32,
                            q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                            topk_method="greedy")


def decode_launches(folder, config, monkeypatch, batch: int = 3, **options) -> collections.Counter:
    """{kernel or aten op: launches} of one decode step of `batch` sequences on the meta device."""
    launched = collections.Counter()
    monkeypatch.setattr(InterpretedFunction, "run",
                        lambda self, *args, grid, warmup, **kwargs: launched.update([self.fn.__name__]))
    meta, dtype = torch.device("meta"), torch.bfloat16
    model = model_class(config.model_type)(config, get_loader(folder, dtype, meta), dtype, meta, **options)
    cache = model.kv_layout.allocate(16, 16, dtype, meta)
    i64, i32 = dict(dtype=torch.int64, device=meta), dict(dtype=torch.int32, device=meta)
    ctx = StepContext(torch.empty(batch, **i64), torch.empty(batch, **i64), torch.empty(batch, **i64),
                      torch.empty(batch + 1, **i32), torch.empty(batch, **i32), torch.empty(batch, 1, **i32), None,
                      False, 10, 10 * batch, batch)
    model(ctx, cache)  # the warm-up step: plans and their arrival counts made once
    launched.clear()
    with OpCount() as ops:
        model(ctx, cache)
    return launched + ops.ops


# arch, checkpoint (None: dense bf16, else the format written by tritonq.quantize), model options, launches per
# layer. Llama / Qwen3: add + RMSNorm, qkv, (qk-norm +) rope + KV write, decode attention, o + residual + RMSNorm,
# gate_up + SiLU-mul, down = 7 (before the fused kernels: 17 and 20; then 9, with the SiLU-mul kernel and the
# separate add + RMSNorm). DeepSeek-V2 (MLA, MoE) and gpt-oss (MoE): 26 and 9, from 69 and 57 (34 and 19 before
# the epilogues: DeepSeek's shared-expert SwiGLU and o_proj, gpt-oss's o_proj; 32 and 18 before routing and alignment
# became one launch, `_route_kernel`, in place of softmax, sort, gather, (renormalization,) scaling and the alignment;
# 28 and 11 before the down expert GEMM summed each token's k slots itself, in place of a zero fill and a sum).
CASES = [("llama", None, {}, 7), ("qwen3", None, {}, 7), ("llama", "gptq", {}, 7), ("qwen3", "gptq", {}, 7),
         ("llama", "fp8", {}, 7), ("llama", "fp8-channel", {}, 7), ("llama", "w8a8", {}, 7),
         ("deepseek_v2", None, {"attention_mode": "latent"}, 26), ("gpt_oss", None, {}, 9)]


@pytest.mark.parametrize("arch, checkpoint, options, expected", CASES,
                         ids=[c[0] + (f"-{c[1]}" if c[1] else "") for c in CASES])
def test_launches_per_decoder_layer(tmp_path, monkeypatch, arch, checkpoint, options, expected):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tritonq.quantize.writer import write_quantized
    counts = []
    for layers in (2, 3):
        config = tiny(arch, layers)
        folder = tmp_path / f"{arch}{layers}"
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        if checkpoint is not None:  # gptq: 4-bit, group 32 (K = 64 and 128 here); fp8: per tensor or "-channel"
            fmt, _, scheme = checkpoint.partition("-")
            folder = write_quantized(folder, tmp_path / f"{arch}{layers}-{checkpoint}", fmt, group_size=32,
                                     fp8_scheme=scheme or "tensor")
            config = AutoConfig.from_pretrained(folder)
        counts.append(decode_launches(folder, config, monkeypatch, **options))
    layer = counts[1] - counts[0]
    print(f"{arch} {checkpoint or 'dense'}: {sum(layer.values())} launches a layer: {dict(layer)}")
    # every architecture: one KV write (rope inside it where the model has the Llama attention), decode attention
    # in one launch (one split), the residual additions inside the norms, SiLU-mul in one kernel
    assert layer["_write_slots_kernel"] == 1 and layer["_decode_split_kernel"] == 1, dict(layer)
    assert not {"_decode_merge_kernel", "silu"} & set(layer), dict(layer)
    if arch in ("llama", "qwen3"):  # SwiGLU in gate_up's epilogue, the residual + post-attention norm in o's
        assert not {"_silu_mul_kernel", "zeros"} & set(layer) and layer["_rms_norm_kernel"] == 1, dict(layer)
    if arch in ("deepseek_v2", "gpt_oss"):  # MoE routing and token alignment: one launch, not ~8 + ~20 torch ops;
        # the experts: two GEMM launches, the down one summing the k slots (no zero fill, sum or cast around them)
        assert layer["_route_kernel"] == 1 and not {"_moe_align_kernel", "softmax", "sigmoid", "sort", "topk",
                                                    "gather", "div", "scatter_add_", "searchsorted",
                                                    "cumsum"} & set(layer), dict(layer)
        assert layer["_moe_gemm_kernel"] == 2 and not {"zeros", "zero_", "fill_", "sum", "_to_copy"} & set(layer), \
            dict(layer)
    if arch != "deepseek_v2":  # MLA rotates its rope dims itself (models/deepseek_v2.py)
        assert not {"neg", "cat", "addcmul"} & set(layer), dict(layer)
    assert expected is None or sum(layer.values()) == expected, dict(layer)
