"""tritonq's Llama against transformers' LlamaForCausalLM on tiny random checkpoints.

Tolerances: dense and int4 checkpoints compute in float32 on both sides with the same weights,
so logits agree to float32 rounding accumulated over a few layers: atol 1e-4 (logits are O(1)).
FP8 also quantizes activations to e4m3 per token (3 mantissa bits: relative rounding error up to
2^-4 per element) which transformers on the dequantized weights does not do, so there we bound
the relative error of the logits, 0.1, and require the same greedy token at most positions.
"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.quantize.writer import write_quantized

ATOL = 1e-4

ROPE = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8, "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0},
}
CONFIGS = {  # name: (kv heads, tied embeddings, bias, rope)
    "gqa_tied_bias_llama3": (2, True, True, "llama3"),
    "mha_untied_linear": (4, False, False, "linear"),
    "gqa_dynamic": (1, False, False, "dynamic"),
    "gqa_yarn": (2, True, False, "yarn"),
}


def write_checkpoint(folder, kv_heads=2, tied=True, bias=True, rope="llama3", hidden=64, seed=0):
    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                         max_position_embeddings=16, tie_word_embeddings=tied, attention_bias=bias,
                         mlp_bias=bias, rope_scaling=dict(ROPE[rope]), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return save_with_random_biases_and_norms(LlamaForCausalLM(config).eval(), tokenizer, folder)


def save_with_random_biases_and_norms(model, tokenizer, folder):
    """Biases ~ N(0, 0.5) and norm weights ~ N(0, 1), so that those code paths matter; saved to folder
    with the tokenizer. Returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0, 0.5 if "bias" in name else 1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def our_prefill_logits(model: tritonq.Model, ids: torch.Tensor) -> torch.Tensor:
    """[B, S, V]: each row's prefill logits through the paged cache."""
    return torch.stack([model.engine.prompt_logits(row) for row in ids.tolist()])


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_transformers(tmp_path, name):
    hf = write_checkpoint(tmp_path, *CONFIGS[name])
    ours = tritonq.load(tmp_path, max_num_seqs=2, max_seq_len=40)
    ids = torch.randint(0, 256, (2, 23))  # longer than max_position_embeddings: dynamic/llama3/yarn scaling matter
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(our_prefill_logits(ours, ids), expected, atol=ATOL, rtol=0)


def hf_greedy(hf, prompt: list[int], n: int, eos: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for one unpadded prompt, cut after the first EOS, and their logprobs."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, eos_token_id=eos, pad_token_id=eos)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [s[0].float().log_softmax(-1)[t].item() for s, t in zip(out.logits, tokens)]
    if eos in tokens:
        cut = tokens.index(eos) + 1
        tokens, logprobs = tokens[:cut], logprobs[:cut]
    return tokens, logprobs


@pytest.mark.parametrize("name", ["gqa_tied_bias_llama3", "mha_untied_linear"])
def test_greedy_20_tokens_match_transformers_single_and_batch(tmp_path, name):
    hf = write_checkpoint(tmp_path, *CONFIGS[name])
    ours = tritonq.load(tmp_path, max_num_seqs=3, max_seq_len=48)
    eos = ours.tokenizer.eos_token_id
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 1, 12)]
    expected = [hf_greedy(hf, p, 20, eos) for p in prompts]
    assert max(len(t) for t, _ in expected) == 20  # not all stopped early at EOS
    # EOS is never forced out by min_new_tokens on our side, so suppress it on neither: compare up to EOS.
    single = ours.generate(prompts[0], max_new_tokens=20, return_dict=True)
    assert single.token_ids[0] == expected[0][0]
    batch = ours.generate(prompts, max_new_tokens=20, return_dict=True)
    for (tokens, logprobs), got, got_logprobs in zip(expected, batch.token_ids, batch.logprobs):
        assert got == tokens
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=ATOL, rtol=0)


QUANTIZED = {  # name: (format, options)
    "awq": ("awq", {"group_size": 32}),
    "gptq_sym": ("gptq", {"group_size": 32, "sym": True}),
    "gptq_asym": ("gptq", {"group_size": 32, "sym": False}),
    "gptq_act_order": ("gptq", {"group_size": 32, "sym": True, "act_order": True}),
    "fp8_tensor": ("fp8", {}),
}


def dequantized_transformers_model(hf: LlamaForCausalLM, folder) -> LlamaForCausalLM:
    """hf with every linear replaced by the quantized checkpoint's weight, dequantized."""
    loader = get_loader(folder, torch.float32, "cpu")
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(loader.get_linear(name).dequantize().float())
    return hf


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_logits_match_transformers_on_dequantized_weights(tmp_path, name):
    fmt, options = QUANTIZED[name]
    hf = write_checkpoint(tmp_path / "dense", *CONFIGS["gqa_tied_bias_llama3"])
    write_quantized(tmp_path / "dense", tmp_path / name, fmt, **options)
    ours = tritonq.load(tmp_path / name, max_num_seqs=1, max_seq_len=24)
    ids = torch.randint(0, 256, (1, 19))
    with torch.no_grad():
        expected = dequantized_transformers_model(hf, tmp_path / name)(ids).logits
    got = our_prefill_logits(ours, ids)
    if fmt == "fp8":
        assert ((got - expected).norm() / expected.norm()).item() < 0.1
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.8
    else:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", ["awq", "fp8", "w8a8"])
def test_triton_interpreter_kernels_match_torch_backend(tmp_path, monkeypatch, fmt):
    """Prefill and two decode steps of an AWQ / fp8 / W8A8 model with the Triton kernels run by the interpreter
    (rmsnorm, the GEMMs with their decode epilogues: SwiGLU in gate_up, residual + RMSNorm in o, attention,
    KV-cache write) against the torch references (GEMM, then the norm or silu_mul)."""
    write_checkpoint(tmp_path / "dense", hidden=32)
    write_quantized(tmp_path / "dense", tmp_path / fmt, fmt, group_size=32)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    triton_out = tritonq.load(tmp_path / fmt, max_num_seqs=2, max_seq_len=8).generate(
        prompts, max_new_tokens=3, return_dict=True)
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    torch_out = tritonq.load(tmp_path / fmt, max_num_seqs=2, max_seq_len=8).generate(
        prompts, max_new_tokens=3, return_dict=True)
    assert triton_out.token_ids == torch_out.token_ids
    for a, b in zip(triton_out.logprobs, torch_out.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)
