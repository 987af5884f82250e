"""gpt-oss end to end against transformers' GptOssForCausalLM on tiny random checkpoints.

Float32 throughout, so ours and transformers differ by summation order only (TOL). The tiny config
keeps every gpt-oss feature live: attention sinks drawn large enough to take a real share of the
softmax, biases on q/k/v/o, the router and the experts drawn non-zero (transformers initializes
some to zero, which would test nothing), an 8-token sliding window on the alternating
"sliding_attention" layers with prompts and decodes past it, yarn rope, GQA 2, and 4 experts with
top-2 routing whose interleaved gate/up rows and clamped SwiGLU (gate logits scaled up so the +-7
clamp is hit) run through our fused MoE. The MXFP4 checkpoint is our writer's (`--format mxfp4`) of
that model; the reference is transformers loading it with its own dequantization (Mxfp4Config(dequantize=
True)), so our format, loader and kernels are checked against transformers' reading of the same files.
"""
import pytest
import torch
from models.paged import PagedRun
from transformers import GptOssConfig, Mxfp4Config
from transformers import GptOssForCausalLM as HFGptOss

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.models.gpt_oss import GptOssForCausalLM
from tritonq.quantize.writer import write_quantized
from tritonq.quant.weights import MXFP4Weight

TOL = dict(atol=2e-4, rtol=1e-4)  # fp32, summation order only
CONFIG = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=256, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              pad_token_id=0,
              rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                   truncate=False, original_max_position_embeddings=64))
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 11, 70, 33], [12, 7, 33, 2, 70]]

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def random_gpt_oss(**overrides) -> HFGptOss:
    """A tiny transformers gpt-oss with every parameter that matters drawn non-zero."""
    torch.manual_seed(0)
    hf = HFGptOss(GptOssConfig(**{**CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
            elif name.endswith("sinks"):
                param.normal_(0, 1.5)
            elif name.endswith("gate_up_proj"):
                param.normal_(0, 0.5)  # gate/up logits of several units: the +-7 clamps are reached
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = random_gpt_oss()
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(folder)
    return folder, hf


def load(folder, hf):
    return GptOssForCausalLM(hf.config, get_loader(folder, torch.float32, "cpu"), torch.float32, "cpu")


@pytest.fixture(params=["torch", "cpu"])
def backend(request, monkeypatch):
    """The torch references (TRITONQ_BACKEND=torch) and the CPU backend (torch's CPU kernels)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if request.param == "torch":
        monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    else:
        monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    return request.param


def test_the_checkpoint_exercises_clamps_windows_and_sinks(checkpoint):
    """The test model is not degenerate: gate/up logits pass the clamp, prompts outrun the window."""
    folder, hf = checkpoint
    layer = hf.model.layers[0]
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    assert max(map(len, PROMPTS)) + 4 > hf.config.sliding_window
    x = layer.post_attention_layernorm(hf.model.embed_tokens(torch.tensor(PROMPTS[0])))
    with torch.no_grad():
        gate_up = x @ layer.mlp.experts.gate_up_proj[0] + layer.mlp.experts.gate_up_proj_bias[0]
    assert gate_up.abs().max() > hf.config.swiglu_limit
    assert layer.self_attn.sinks.abs().max() > 1


def test_prefill_and_decode_logits_match_transformers(checkpoint, backend):
    """Two prompts (11 and 5 tokens) prefilled as one batch over the paged cache, then 4 decode steps."""
    folder, hf = checkpoint
    run = PagedRun(load(folder, hf), 2, 16)
    steps = [[30, 31, 32, 33], [50, 51, 52, 53]]
    for b, ours in enumerate(run.prefill_then_decode(PROMPTS, steps)):
        with torch.no_grad():
            expected = hf(torch.tensor([PROMPTS[b] + steps[b]])).logits[0]
        torch.testing.assert_close(ours, expected, **TOL)


def test_chunked_prefill_past_the_window_matches_transformers(checkpoint, backend):
    """A 30-token prompt prefilled in chunks of 9, 1 and 20: each chunk attends to pages earlier chunks
    wrote, the sliding layer only to the last 8 keys."""
    folder, hf = checkpoint
    prompt = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    run = PagedRun(load(folder, hf), 1, 32)
    ours = torch.cat([run.prefill([prompt[a:b]])[0] for a, b in ((0, 9), (9, 10), (10, 30))])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, expected, **TOL)


def test_greedy_tokens_identical_to_transformers(checkpoint, backend):
    folder, hf = checkpoint
    prompt = PROMPTS[0]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    run = PagedRun(load(folder, hf), 1, len(prompt) + 12)
    tokens = [int(run.prefill([prompt], every_row=False)[0].argmax())]
    for _ in range(11):
        tokens.append(int(run.decode([tokens[-1]])[0].argmax()))
    assert tokens == expected


def test_triton_kernels_match_transformers(checkpoint, monkeypatch):
    """Prefill + 2 decode steps through the Triton kernels (interpreter): sinks in paged prefill and the
    split-KV merge, the window, fused MoE with expert biases and the clamped SwiGLU epilogue."""
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    folder, hf = checkpoint
    run = PagedRun(load(folder, hf), 1, 16)
    prompt, steps = PROMPTS[0], [3, 4]
    logits = [run.prefill([prompt])[0]]
    for token in steps:
        logits.append(run.decode([token]))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + steps])).logits[0]
    torch.testing.assert_close(torch.cat(logits), expected, **TOL)


def test_mixed_batches_through_the_engine_match_transformers_greedy(tmp_path):
    """tritonq.load + Model.generate: three prompts of different lengths batched (prefill and decode
    steps mixing sequences at different positions) give transformers' greedy tokens for each alone."""
    tokenizer = byte_tokenizer()
    hf = random_gpt_oss(vocab_size=len(tokenizer))
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = tritonq.load(tmp_path, device="cpu", dtype=torch.float32, max_num_seqs=3, max_seq_len=40)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1][:2] + PROMPTS[0]]
    ours = model.generate(prompts, max_new_tokens=10, return_dict=True).token_ids
    for prompt, tokens in zip(prompts, ours):
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert tokens == expected.tolist()



@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoint, tmp_path_factory):
    """(our MXFP4 checkpoint of the tiny model, transformers' model loaded from it with its own dequantization)."""
    folder, _ = checkpoint
    quantized = write_quantized(folder, tmp_path_factory.mktemp("gpt_oss_mxfp4"), "mxfp4")
    reference = HFGptOss.from_pretrained(quantized, quantization_config=Mxfp4Config(dequantize=True),
                                         dtype=torch.float32).eval()
    return quantized, reference


def test_mxfp4_experts_load_as_mxfp4_weights(mxfp4_checkpoint):
    quantized, reference = mxfp4_checkpoint
    model = load(quantized, reference)
    moe = model.layers[0].mlp
    assert isinstance(moe.gate_up, MXFP4Weight) and isinstance(moe.down, MXFP4Weight)
    assert moe.gate_up.blocks.shape == (4, 192, 2, 16) and moe.down.scales.shape == (4, 64, 3)


@pytest.mark.parametrize("kernels", ["torch", "cpu", "triton"])
def test_mxfp4_checkpoint_matches_transformers_dequantized(mxfp4_checkpoint, kernels, monkeypatch):
    """Prefill of two prompts + 3 decode steps: ours on the MXFP4 experts (CPU backend: dequantized once;
    Triton: the in-kernel decode) vs transformers on its own dequantization of the same checkpoint."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if kernels == "cpu":
        monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    else:
        monkeypatch.setenv("TRITONQ_BACKEND", kernels)
    quantized, reference = mxfp4_checkpoint
    run = PagedRun(load(quantized, reference), 2, 16)
    steps = [[30, 31, 32], [50, 51, 52]]
    for b, ours in enumerate(run.prefill_then_decode(PROMPTS, steps)):
        with torch.no_grad():
            expected = reference(torch.tensor([PROMPTS[b] + steps[b]])).logits[0]
        torch.testing.assert_close(ours, expected, **TOL)


def test_mxfp4_greedy_tokens_identical_to_transformers(mxfp4_checkpoint, backend):
    quantized, reference = mxfp4_checkpoint
    prompt = PROMPTS[1]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    run = PagedRun(load(quantized, reference), 1, len(prompt) + 12)
    tokens = [int(run.prefill([prompt], every_row=False)[0].argmax())]
    for _ in range(11):
        tokens.append(int(run.decode([tokens[-1]])[0].argmax()))
    assert tokens == expected.tolist()
