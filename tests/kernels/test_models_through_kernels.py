"""Tiny models end to end through the Triton kernels on the test device vs the torch references on the CPU.

A tiny Llama (AWQ, GPTQ act-order, FP8 checkpoints from our writer) and a tiny DeepSeek-V2 (AWQ
experts, expanded and latent attention): last-token logits through the kernels (fp16 on a GPU;
fp32 in the interpreter) against TRITONQ_BACKEND=torch in float32 on the CPU, relative to the
largest logit (tolerance: tests/tolerances.py "model"). Formerly `python -m tritonq.check`'s model cases.
"""
import contextlib
import os
from pathlib import Path

import pytest
import tolerances
import torch

MODELS = [("llama", "awq", {"group_size": 64}, {}), ("llama", "gptq", {"group_size": 64, "act_order": True}, {}),
          ("llama", "fp8", {}, {}), ("deepseek_v2", "awq", {"group_size": 64}, {"attention_mode": "expanded"}),
          ("deepseek_v2", "awq", {"group_size": 64}, {"attention_mode": "latent"})]


def _tiny_deepseek_v2(folder: Path) -> Path:
    """A seeded random DeepSeek-V2 (MLA with qk 16+8 / v 16 heads, 8 routed + 1 shared expert)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(vocab_size=300, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=64, q_lora_rank=None,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                              topk_method="greedy", max_position_embeddings=256, bos_token_id=None,
                              eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(config).save_pretrained(folder)
    return folder


@contextlib.contextmanager
def _torch_backend():
    before = os.environ.get("TRITONQ_BACKEND")
    os.environ["TRITONQ_BACKEND"] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITONQ_BACKEND"]
        else:
            os.environ["TRITONQ_BACKEND"] = before


@pytest.fixture(scope="module")
def dense_checkpoints(tmp_path_factory):
    from tritonq.demo import write_tiny_llama
    tmp = tmp_path_factory.mktemp("dense")
    return {"llama": write_tiny_llama(tmp / "llama", hidden_size=64, num_layers=2),
            "deepseek_v2": _tiny_deepseek_v2(tmp / "deepseek")}


@pytest.mark.parametrize("arch, fmt, opts, kwargs", MODELS,
                         ids=[f"{a}-{f}{'-' + k['attention_mode'] if k else ''}" for a, f, _, k in MODELS])
def test_model_logits_through_kernels_match_cpu_torch(dense_checkpoints, tmp_path, device, arch, fmt, opts, kwargs):
    from transformers import AutoConfig

    from tritonq.engine.runner import prefill_logits
    from tritonq.formats.registry import get_loader
    from tritonq.models import model_class
    from tritonq.quantize.writer import write_quantized

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    ids = [256] + list(b"Tell me about Triton")
    folder = write_quantized(dense_checkpoints[arch], tmp_path / f"{arch}-{fmt}", fmt, **opts)
    config = AutoConfig.from_pretrained(folder)
    logits = []
    for dev, dt, backend in ((device, dtype, contextlib.nullcontext), (torch.device("cpu"), torch.float32,
                                                                       _torch_backend)):
        with backend():
            model = model_class(config.model_type)(config, get_loader(folder, dt, dev), dt, dev, **kwargs)
            logits.append(prefill_logits(model, ids, last_only=True).float().cpu())
    ours, ref = logits
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err <= tolerances.table("model")[dtype], f"max |ours - ref| / max |ref| = {err:.2e}"
