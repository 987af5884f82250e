"""Tiny Llama and DeepSeek-V2 end to end on the CPU backend (kernels/cpu/lowbit.py, kernels/cpu/attention.py:
no interpreter, no TRITONQ_BACKEND=torch) against transformers on the dequantized weights, and dense Llama /
Mistral (sliding window) through the CPU attention path against the torch references (TRITONQ_BACKEND=torch).

Tolerances, stated once (the per-GEMM ones are in kernels/cpu/lowbit.py and tests/kernels/cpu/test_cpu_lowbit.py):
  fp32 paths (GPTQ 8-bit, FP8 weight-only as on GPUs below sm_89): the same arithmetic in another
      summation order, as test_llama.py / test_deepseek_v2.py on the torch references: Llama atol 1e-4,
      DeepSeek atol 2e-4 rtol 1e-4 (|logits| <= ~1).
  int4 (bf16 activations): each int4 GEMM's output is off by ~3e-3 of its scale (RMS of the bf16
      roundings of test_cpu_lowbit.py), below 2^-8; independent errors of the n int4 GEMMs
      on the longest path add like a random walk, so the logits' relative L2 error is below
      2^-8 * sqrt(n) (Llama, 2 layers: n = 8 -> 1.1e-2; DeepSeek-V2, 3 layers of q_a, q_b, kv_a, kv_b, o,
      gate_up, down: n = 21 -> 1.8e-2), and each logit within that fraction of max |logit|.
  CPU attention vs the references, fp32 both: summation order in attention only, atol 1e-4 (|logits| <= ~1).
Greedy decoding (the decode path, M = 1) must give transformers' tokens; the only divergence allowed is
at a step where transformers' own top-2 logits are closer than twice the logit tolerance (a tie at this
precision), after which the two sequences are no longer comparable.
"""
import pytest
import torch
from models.paged import PagedRun
from models.test_llama_family import MAX_LEN, build, write_checkpoint as write_family_checkpoint
from test_deepseek_v2 import COMMON, CONFIGS as DEEPSEEK_CONFIGS, dequantized_reference
from test_llama import CONFIGS as LLAMA_CONFIGS, our_prefill_logits, write_checkpoint
from transformers import DeepseekV2Config
from transformers import DeepseekV2ForCausalLM as HFDeepseekV2

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.kernels.cpu import lowbit as cpu_lowbit
from tritonq.quantize.writer import write_quantized
from tritonq.quant.weights import FP8Weight, Int4Weight

INT4_GEMMS_IN_SERIES = {"llama": 8, "deepseek": 21}
FP32_TOL = {"llama": dict(atol=1e-4, rtol=0), "deepseek": dict(atol=2e-4, rtol=1e-4)}

FORMATS = {  # name: (format, write_quantized options, CPU path of its linears)
    "awq_g32": ("awq", dict(group_size=32), cpu_lowbit.CPUInt4Weight),
    "gptq_g64_asym": ("gptq", dict(group_size=64, sym=False), cpu_lowbit.CPUInt4Weight),
    "gptq_act_order": ("gptq", dict(group_size=32, sym=True, act_order=True), cpu_lowbit.CPUInt4Weight),
    "gptq_per_channel": ("gptq", dict(group_size=-1, sym=False), cpu_lowbit.CPUInt4Weight),
    "gptq8": ("gptq", dict(bits=8, group_size=32), cpu_lowbit.CPUDenseWeight),
    "gptq8_sym": ("gptq", dict(bits=8, group_size=32, sym=True), cpu_lowbit.CPUInt8Weight),
    "fp8_channel": ("fp8", dict(fp8_scheme="channel"), cpu_lowbit.CPUDenseWeight),
    "fp8_tensor": ("fp8", dict(fp8_scheme="tensor"), cpu_lowbit.CPUDenseWeight),
}
# (block fp8 is written with 128 x 128 blocks, which these tiny fused q/k/v and gate/up cannot hold;
# tests/kernels/cpu/test_cpu_lowbit.py covers it)
DEEPSEEK_FORMATS = ["awq_g32", "gptq_act_order", "gptq8", "fp8_channel"]


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def assert_logits_close(got, expected, name, model):
    if FORMATS[name][2] in (cpu_lowbit.CPUDenseWeight, cpu_lowbit.CPUInt8Weight):  # fp32 weights and sums
        torch.testing.assert_close(got, expected, **FP32_TOL[model])
        return FP32_TOL[model]["atol"]
    rel = 2**-8 * INT4_GEMMS_IN_SERIES[model] ** 0.5
    assert ((got - expected).norm() / expected.norm()).item() < rel
    tol = rel * expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=tol, rtol=0)
    return tol


def assert_greedy_matches(ours_tokens, reference, prompt, tol):
    """ours_tokens equal transformers' greedy tokens, up to a step where its top-2 logits tie within 2 * tol."""
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=len(ours_tokens), do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    expected = out.sequences[0, len(prompt):].tolist()
    for step, (got, want, logits) in enumerate(zip(ours_tokens, expected, out.logits)):
        if got != want:
            top2 = logits[0].topk(2).values
            assert (top2[0] - top2[1]).item() < 2 * tol, f"step {step}: token {got}, transformers {want}"
            return step
    return len(expected)


def hf_llama_on_dequantized(hf, folder):
    """hf with every quantized linear's weight and bias replaced by what the checkpoint stores."""
    loader = get_loader(folder, torch.float32, "cpu")
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                w = loader.get_linear(name, bias=module.bias is not None)
                module.weight.copy_(w.dequantize().float())
                if module.bias is not None:
                    module.bias.copy_(w.bias.float())
    return hf


@pytest.mark.parametrize("name", list(FORMATS))
def test_llama_on_cpu_backend_matches_transformers(tmp_path, name):
    fmt, options, path = FORMATS[name]
    hf = write_checkpoint(tmp_path / "dense", *LLAMA_CONFIGS["gqa_tied_bias_llama3"])
    write_quantized(tmp_path / "dense", tmp_path / name, fmt, **options)
    ours = tritonq.load(tmp_path / name, max_num_seqs=1, max_seq_len=40)
    qkv = ours.model.layers[0].self_attn.qkv_proj.weight
    assert isinstance(qkv, FP8Weight if fmt == "fp8" else Int4Weight)
    assert isinstance(cpu_lowbit._prepared.get(qkv), path)  # prepared at load
    reference = hf_llama_on_dequantized(hf, tmp_path / name)
    ids = torch.randint(0, 256, (1, 19))
    got = our_prefill_logits(ours, ids)
    prompt = [3, 1, 4, 1, 5]
    tokens = ours.generate(prompt, max_new_tokens=16, return_dict=True).token_ids[0]
    with torch.no_grad():
        expected = reference(ids).logits
    tol = assert_logits_close(got, expected, name, "llama")
    assert_greedy_matches(tokens, reference, prompt, tol)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    hf = HFDeepseekV2(DeepseekV2Config(**dict(COMMON, vocab_size=len(tokenizer)), **DEEPSEEK_CONFIGS["v2"])).eval()
    with torch.no_grad():
        for param_name, param in hf.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0, 0.1)
    folder = tmp_path_factory.mktemp("deepseek")
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", DEEPSEEK_FORMATS)
def test_deepseek_v2_on_cpu_backend_matches_transformers(deepseek, name, tmp_path):
    fmt, options, path = FORMATS[name]
    quantized = write_quantized(deepseek, tmp_path / name, fmt, **options)
    (tmp_path / "ref").mkdir()
    reference = dequantized_reference(deepseek, quantized, tmp_path / "ref")
    ours = tritonq.load(quantized, max_num_seqs=1, max_seq_len=40)
    prompt = [5, 17, 3, 88, 41, 9, 60]
    got = our_prefill_logits(ours, torch.tensor([prompt]))[0]
    moe = ours.model.layers[1].mlp
    assert all(isinstance(p, path) for p in cpu_lowbit.prepare_experts(moe.experts.down))  # experts on the same CPU path
    tokens = ours.generate(prompt, max_new_tokens=12, return_dict=True).token_ids[0]
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    tol = assert_logits_close(got, expected, name, "deepseek")
    assert_greedy_matches(tokens, reference, prompt, tol)


@pytest.mark.parametrize("name", ["qwen2_untied", "mistral_window6"])
def test_cpu_attention_logits_match_torch_backend_through_prefill_chunk_and_decode(tmp_path, monkeypatch, name):
    """Dense GQA 4/2 models, three sequences on interleaved pages: whole prompts (1, 9 and 37 tokens), a
    second chunk after each cached prefix, then three decode steps; every row's logits through
    kernels/cpu/attention.py equal those of the torch references step by step."""
    write_family_checkpoint(tmp_path, name)
    model = build(tmp_path)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (1, 9, 37)]
    chunks = [torch.randint(0, 256, (n,)).tolist() for n in (2, 17, 5)]
    tokens = torch.randint(0, 256, (3, 3)).tolist()

    def run():
        paged = PagedRun(model, len(prompts), MAX_LEN)
        steps = paged.prefill(prompts) + paged.prefill(chunks)
        return steps + [paged.decode(step) for step in tokens]

    fast = run()
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    for got, expected in zip(fast, run(), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
