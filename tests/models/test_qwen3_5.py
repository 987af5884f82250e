"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet hybrids) against transformers' own models on tiny random
checkpoints, float32 on both sides.

Each case has three linear-attention layers and one full-attention layer (layer_types as transformers derives them,
plus a case with two full layers), value heads twice the key heads (grouped delta rule), a 4-tap conv, partial rotary
0.25 and a gated attention output. Prefill logits of a short and a long prompt in one step, a chunked prefill then
decode steps (the recurrent state carried across steps), and greedy tokens through the engine equal transformers on
each prompt alone. The norms' offsets, A_log, dt_bias and the gated norm's weight are random, so every term matters.
Both sides compute in float32 with the same weights and differ by summation order only (ATOL 1e-4 on O(1) logits).
"""
import copy
import json

import pytest
import torch
from models.paged import PagedRun
from models.test_llama import hf_greedy
from models.test_llama_family import MAX_LEN, build
from safetensors.torch import load_file, save_file
from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3_5TextConfig,
                          Qwen3NextConfig, Qwen3NextForCausalLM)

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.models.moe import SparseMoE
from tritonq.quantize.writer import write_quantized
from tritonq.quant.weights import FP8Weight, Int4Weight, W8A8Weight

ATOL = 1e-4
COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, max_position_embeddings=MAX_LEN, rms_norm_eps=1e-6, initializer_range=0.1)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CASES = {  # name: (transformers config, transformers model, config fields beyond COMMON)
    "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(intermediate_size=96)),
    # two full-attention layers (1 and 3), tied embeddings, biases on the attention projections
    "qwen3_5_text_tied": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, dict(
        intermediate_size=96, tie_word_embeddings=True, attention_bias=True,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])),
    "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, MOE),
    # layer 1 dense (mlp_only_layers), unnormalized top-2
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, dict(MOE, intermediate_size=96, mlp_only_layers=[1],
                                                               norm_topk_prob=False)),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def write_checkpoint(folder, name: str, seed: int = 0, **overrides):
    """Save a tiny random model of CASES[name] with the byte tokenizer; returns the transformers model."""
    config_cls, model_cls, fields = CASES[name]
    tokenizer = byte_tokenizer()
    config = config_cls(**{"vocab_size": len(tokenizer), **COMMON, **fields, **overrides},
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith(("bias", "dt_bias")):
                p.normal_(0, 0.5)
            elif key.endswith("A_log"):
                p.uniform_(-2, 1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(hf)(torch.tensor([tokens])).logits[0]


def prompts() -> list[list[int]]:
    return [torch.randint(0, 256, (n,)).tolist() for n in (5, 40)]


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_chunks_and_decode_match_transformers(tmp_path, name):
    """One batched prefill of a short and a long prompt; then the same prompts in two chunks (the second chunk
    continues from the state the first left) and 3 decode steps: every row equals transformers alone."""
    hf = write_checkpoint(tmp_path, name)
    ours = build(tmp_path)
    assert [layer.linear for layer in ours.layers] == [t == "linear_attention" for t in hf.config.layer_types]
    if name in ("qwen3_5_moe_text", "qwen3_next"):
        assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == (
            [True, False, True, True] if name == "qwen3_next" else [True] * 4)
    ps = prompts()
    for prompt, logits in zip(ps, PagedRun(ours, 2, MAX_LEN).prefill(ps)):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    run = PagedRun(ours, 2, MAX_LEN)
    first = run.prefill([p[:3] for p in ps])
    second = run.prefill([p[3:] for p in ps])
    extra = [torch.randint(0, 256, (3,)).tolist() for _ in ps]
    decoded = [run.decode([e[i] for e in extra]) for i in range(3)]
    for b, prompt in enumerate(ps):
        ours_rows = torch.cat([first[b], second[b]] + [d[b:b + 1] for d in decoded])
        torch.testing.assert_close(ours_rows, hf_logits(hf, prompt + extra[b]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_match_transformers(tmp_path, name):
    """Three prompts batched through the engine (prefill, then decode steps): each one's 10 greedy tokens and
    logprobs equal transformers on it alone."""
    hf = write_checkpoint(tmp_path, name)
    ps = prompts() + [[7]]
    ours = tritonq.load(tmp_path, max_num_seqs=3, max_seq_len=MAX_LEN)
    eos = ours.tokenizer.eos_token_id
    expected = [hf_greedy(copy.deepcopy(hf), p, 10, eos) for p in ps]
    got = ours.generate(ps, max_new_tokens=10, return_dict=True)
    for (tokens, logprobs), got_tokens, got_logprobs in zip(expected, got.token_ids, got.logprobs):
        assert got_tokens == tokens
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=ATOL, rtol=0)


def test_image_text_checkpoint_loads_its_language_model(tmp_path):
    """A released-style Qwen3.5 checkpoint (model_type qwen3_5: model.language_model.*, a vision tower under
    model.visual.*, mtp.* layers): the language model gives transformers' text logits, the rest is left unread
    with a warning naming it."""
    hf = write_checkpoint(tmp_path / "text", "qwen3_5_text")
    tensors = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in load_file(tmp_path / "text" / "model.safetensors").items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    folder = tmp_path / "image_text"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    text["model_type"] = "qwen3_5_text"
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
              "vision_config": {"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 64},
              "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    byte_tokenizer().save_pretrained(folder)
    with pytest.warns(UserWarning) as warned:
        ours = build(folder)
    messages = " ".join(str(w.message) for w in warned)
    assert "model.visual.patch_embed.proj.weight" in messages and "mtp.fc.weight" in messages
    prompt = prompts()[1]
    torch.testing.assert_close(PagedRun(ours, 1, MAX_LEN).prefill([prompt])[0], hf_logits(hf, prompt), atol=ATOL,
                               rtol=0)


@pytest.mark.parametrize("field, value, match", [
    ("linear_num_value_heads", 3, "linear_num_value_heads=3"),
    ("num_key_value_heads", 3, "num_key_value_heads=3"),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"], "layer_types"),
    ("layer_types", ["linear_attention"] * 4, "layer_types"),
    ("hidden_act", "gelu", "hidden_act")])
def test_bad_config_is_refused_naming_the_key(tmp_path, field, value, match):
    """Value heads that do not split over the key heads, query heads over KV heads, a layer type not listed, no
    full-attention layer, another activation: refused before any weight is read, naming the key."""
    write_checkpoint(tmp_path, "qwen3_5_text")
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        tritonq.load(tmp_path, max_num_seqs=1, max_seq_len=32)


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_next"])
def test_triton_kernels_match_transformers(tmp_path, monkeypatch, name):
    """The conv, the chunked and recurrent delta rule, the gated norm and attention through the Triton kernels
    (interpreter), small shapes: a batched prefill and 3 greedy tokens of each prompt equal transformers alone."""
    hf = write_checkpoint(tmp_path, name, hidden_size=32, num_hidden_layers=2, intermediate_size=48,
                          moe_intermediate_size=16, shared_expert_intermediate_size=16,
                          layer_types=["linear_attention", "full_attention"], mlp_only_layers=[])
    ps = [torch.randint(0, 256, (n,)).tolist() for n in (5, 19)]
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    ours = build(tmp_path)
    for prompt, logits in zip(ps, PagedRun(ours, 2, MAX_LEN).prefill(ps)):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    model = tritonq.load(tmp_path, max_num_seqs=2, max_seq_len=MAX_LEN)
    eos = model.tokenizer.eos_token_id
    got = model.generate(ps, max_new_tokens=3, return_dict=True)
    for prompt, tokens in zip(ps, got.token_ids):
        assert tokens == hf_greedy(copy.deepcopy(hf), prompt, 3, eos)[0]


def int8_input(module, args):
    """Forward pre-hook: round a linear's input per token to int8 as compressed-tensors' dynamic symmetric int8
    does (scale = absmax / 127.5, the half range of [-128, 127]; round half to even), as our int8 GEMM does."""
    x = args[0]
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127.5
    return ((x / scale).clamp(-128, 127).round() * scale,)


QUANTIZED = {  # format: (case, writer options); every linear quantized (in projections, out_proj, attention, MLP)
    "awq": ("qwen3_5_moe_text", {"group_size": 32}),
    "gptq": ("qwen3_5_moe_text", {"group_size": 32, "act_order": True}),
    "fp8": ("qwen3_5_moe_text", {"fp8_scheme": "channel"}),
    # compressed-tensors int-quantized (llm-compressor's W8A8 INT8); the fused MoE has no int8 x int8 experts
    "w8a8": ("qwen3_5_text", {"w8a8_scheme": "channel"}),
}


@pytest.mark.parametrize("fmt", list(QUANTIZED))
def test_quantized_checkpoint_matches_transformers_on_dequantized_weights(tmp_path, fmt):
    """A Qwen3.5-MoE (W8A8: dense Qwen3.5) checkpoint quantized by tritonq's writer (AWQ, GPTQ with act-order,
    fp8, compressed-tensors W8A8 INT8): prefill logits and greedy tokens equal transformers holding the dequantized weights (fp8 / w8a8:
    its dense linears round their inputs per token to e4m3 / int8, as our GEMMs do)."""
    from models.test_moe_models import round_inputs_to_fp8
    sizes = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                 shared_expert_intermediate_size=32)  # every N and K a whole number of packs / groups
    case, options = QUANTIZED[fmt]
    write_checkpoint(tmp_path / "dense", case, **sizes)
    folder = write_quantized(tmp_path / "dense", tmp_path / fmt, fmt, **options)
    loader = get_loader(folder, torch.float32, "cpu")
    prefixes = {k.rpartition(".")[0] for k in load_file(folder / "model.safetensors")}
    dequantized = {p: loader.get_linear(p).dequantize().float() for p in prefixes if loader.is_quantized(p)}
    assert any("in_proj_qkv" in p for p in dequantized) and any(".experts." in p or "mlp.up_proj" in p
                                                                for p in dequantized)
    tensors = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()
               if k.rpartition(".")[0] not in dequantized}
    tensors.update({f"{p}.weight": w.contiguous() for p, w in dequantized.items()})
    (tmp_path / "reference").mkdir()
    save_file(tensors, str(tmp_path / "reference" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (tmp_path / "reference" / "config.json").write_text(json.dumps(config))
    hf = CASES[case][1].from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()
    if fmt == "fp8":
        round_inputs_to_fp8(hf, set(dequantized))
    if fmt == "w8a8":
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name in dequantized:
                module.register_forward_pre_hook(int8_input)
    ours = build(folder)
    kind = {"fp8": FP8Weight, "w8a8": W8A8Weight}.get(fmt, Int4Weight)
    assert isinstance(ours.layers[0].self_attn.in_proj.weight, kind)
    ps = prompts()
    # w8a8: each token's absmax input sits on a tie (x / (absmax / 127.5) = +-127.5), so fp32 summation noise
    # decides -127 or -128 for a negative one, on either side, in every linear of every layer: one int8 step of
    # the largest input (~0.4% of it) per token and linear, carried through the recurrence into O(1) logits
    atol = 0.15 if fmt == "w8a8" else ATOL
    for prompt, logits in zip(ps, PagedRun(ours, 2, MAX_LEN).prefill(ps)):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=atol, rtol=0)
    model = tritonq.load(folder, max_num_seqs=2, max_seq_len=MAX_LEN)
    got = model.generate(ps, max_new_tokens=6, return_dict=True)
    for prompt, tokens in zip(ps, got.token_ids):
        assert tokens == hf_greedy(copy.deepcopy(hf), prompt, 6, model.tokenizer.eos_token_id)[0]
