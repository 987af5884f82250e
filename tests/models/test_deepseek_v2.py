"""DeepSeek-V2 end to end against transformers' DeepseekV2ForCausalLM on tiny random checkpoints.

Everything runs in float32, through the torch references (TRITONQ_BACKEND=torch) or, in one
test, the Triton kernels under the interpreter, so ours and transformers differ only in summation
order: logits agree to TOL (|logits| ~ 1 here). Quantized checkpoints are compared with
transformers on the dequantized weights (and, for fp8, the same per-token e4m3 activations).
"""
import copy
import shutil

import pytest
import torch
from models.paged import PagedRun
from safetensors.torch import save_file
from transformers import DeepseekV2Config
from transformers import DeepseekV2ForCausalLM as HFDeepseekV2
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.checkpoint import Weights
from tritonq.formats.registry import get_loader
from tritonq.models.deepseek_v2 import DeepseekV2ForCausalLM, default_attention_mode, kv_bytes_per_token
from tritonq.quantize.writer import write_quantized
from tritonq.quant.weights import FP8Weight, Int4Weight

TOL = dict(atol=2e-4, rtol=1e-4)  # fp32, summation order only
MODES = ("expanded", "latent")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              max_position_embeddings=256, initializer_range=0.1, first_k_dense_replace=1, n_shared_experts=2,
              bos_token_id=None, eos_token_id=None, pad_token_id=0)
CONFIGS = {
    # V2-Lite style: one q_proj, greedy routing over all experts, default rope.
    "lite": dict(q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=2, topk_method="greedy"),
    # V2 style: q LoRA, attention biases, group-limited routing, scaled expert weights, yarn with mscale_all_dim.
    "v2": dict(q_lora_rank=32, attention_bias=True, n_routed_experts=8, num_experts_per_tok=3,
               topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.5,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                    original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
                                    mscale=1.0, mscale_all_dim=0.8)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(folder, transformers model) for a tiny random DeepSeek-V2 saved to disk."""
    torch.manual_seed(0)
    hf = HFDeepseekV2(DeepseekV2Config(**COMMON, **CONFIGS[request.param])).eval()
    with torch.no_grad():  # transformers initializes biases to zero, which would test nothing
        for name, param in hf.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return folder, hf


def load(folder, hf, mode):
    return DeepseekV2ForCausalLM(hf.config, get_loader(folder, torch.float32, "cpu"), torch.float32, "cpu",
                                 attention_mode=mode)


PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 7, 33, 2, 70]]


@pytest.mark.parametrize("mode", MODES)
def test_prefill_and_decode_logits_match_transformers(checkpoint, mode):
    """A batch of two prompts over the paged cache, then 4 decode steps at unequal positions."""
    folder, hf = checkpoint
    model = load(folder, hf, mode)
    steps = [[30, 31, 32, 33], [50, 51, 52, 53]]
    run = PagedRun(model, 2, 16)
    ours = run.prefill_then_decode(PROMPTS, steps)
    last = PagedRun(model, 2, 16).prefill(PROMPTS, every_row=False)
    torch.testing.assert_close(last, torch.stack([rows[len(p) - 1] for rows, p in zip(ours, PROMPTS)]), **TOL)
    for b in range(2):
        with torch.no_grad():
            expected = hf(torch.tensor([PROMPTS[b] + steps[b]])).logits[0]
        torch.testing.assert_close(ours[b], expected, **TOL)


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_over_cached_pages_matches_transformers(checkpoint, mode):
    """A 40-token prompt prefilled in chunks of 17, 1 and 22 tokens (each attending to the pages the
    earlier chunks wrote, across the 16-token block boundaries) gives transformers' logits."""
    folder, hf = checkpoint
    prompt = torch.randint(0, 96, (40,)).tolist()
    run = PagedRun(load(folder, hf, mode), 1, 48)
    ours = torch.cat([run.prefill([prompt[a:b]])[0] for a, b in ((0, 17), (17, 18), (18, 40))])
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, expected, **TOL)


def prefill(model, prompt):
    """[S, V] prefill logits of one prompt over a fresh paged cache."""
    return PagedRun(model, 1, len(prompt)).prefill([prompt])[0]


def greedy(model, prompt, n_tokens):
    run = PagedRun(model, 1, len(prompt) + n_tokens)
    tokens = [int(run.prefill([prompt], every_row=False)[0].argmax())]
    for _ in range(n_tokens - 1):
        tokens.append(int(run.decode([tokens[-1]])[0].argmax()))
    return tokens


@pytest.mark.parametrize("mode", MODES)
def test_greedy_20_tokens_identical_to_transformers(checkpoint, mode):
    folder, hf = checkpoint
    prompt = PROMPTS[0]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    assert greedy(load(folder, hf, mode), prompt, 20) == expected


@pytest.mark.parametrize("mode", MODES)
def test_triton_kernels_match_transformers(mode, tmp_path, monkeypatch):
    """The same prefill + 2 decode steps through the real Triton kernels (interpreter on CPU):
    attention on the 24/16 head dims, the latent cache's strided value view, fused MoE."""
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    hf = HFDeepseekV2(DeepseekV2Config(**dict(COMMON, num_hidden_layers=2), **CONFIGS["v2"])).eval()
    hf.save_pretrained(tmp_path)
    run = PagedRun(load(tmp_path, hf, mode), 1, 8)
    prompt, steps = PROMPTS[1], [3, 4]
    logits = run.prefill([prompt])
    for token in steps:
        logits.append(run.decode([token]))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + steps])).logits[0]
    torch.testing.assert_close(torch.cat(logits), expected, **TOL)


def test_load_and_generate_end_to_end(tmp_path):
    """tritonq.load (registry -> AWQ loader -> model) + Model.generate on a batch of two prompts give
    transformers' greedy tokens on the dequantized weights."""
    tokenizer = byte_tokenizer()
    config = DeepseekV2Config(**dict(COMMON, num_hidden_layers=2, vocab_size=len(tokenizer)), **CONFIGS["v2"])
    HFDeepseekV2(config).save_pretrained(tmp_path / "dense")
    tokenizer.save_pretrained(tmp_path / "dense")
    quantized = write_quantized(tmp_path / "dense", tmp_path / "awq", "awq", group_size=32)
    (tmp_path / "ref").mkdir()
    reference = dequantized_reference(tmp_path / "dense", quantized, tmp_path / "ref")
    model = tritonq.load(quantized, device="cpu", max_num_seqs=2, max_seq_len=32)
    prompts = [PROMPTS[0], PROMPTS[1]]
    ours = model.generate(prompts, max_new_tokens=10, return_dict=True).token_ids
    for prompt, tokens in zip(prompts, ours):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert tokens == expected.tolist()


def test_attention_modes_agree(checkpoint):
    """Latent cache with absorbed kv_b_proj gives the logits of the expanded K/V cache."""
    folder, hf = checkpoint
    logits = {}
    for mode in MODES:
        run = PagedRun(load(folder, hf, mode), 1, 12)
        steps = [run.prefill([PROMPTS[1]], every_row=False)[0]]
        for token in [4, 8, 15, 16, 23]:
            steps.append(run.decode([token])[0])
        logits[mode] = torch.stack(steps)
    torch.testing.assert_close(logits["latent"], logits["expanded"], **TOL)


def test_norm_topk_prob_renormalizes_like_deepseek(tmp_path):
    """DeepSeek's code divides the top-k weights by their sum (and then skips routed_scaling_factor);
    transformers 5 ignores norm_topk_prob, so its router output is renormalized here by hand."""
    config = DeepseekV2Config(**dict(COMMON, num_hidden_layers=2), **dict(CONFIGS["v2"], norm_topk_prob=True))
    hf = HFDeepseekV2(config).eval()
    hf.save_pretrained(tmp_path)
    gate = hf.model.layers[1].mlp.gate
    route = gate.forward

    def renormalized(hidden_states):
        logits, weights, ids = route(hidden_states)
        return logits, weights / weights.sum(-1, keepdim=True), ids
    gate.forward = renormalized
    prompt = PROMPTS[0]
    model = load(tmp_path, hf, "latent")
    ours = prefill(model, prompt)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, expected, **TOL)


def test_moe_layer_freq_puts_dense_mlps_between_moe_layers(tmp_path):
    """DeepSeek's rule: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0.
    transformers ignores moe_layer_freq, so its layer 1 is swapped for a dense MLP by hand."""
    config = DeepseekV2Config(**dict(COMMON, first_k_dense_replace=0, moe_layer_freq=2), **CONFIGS["lite"])
    hf = HFDeepseekV2(config).eval()
    hf.model.layers[1].mlp = DeepseekV2MLP(config)
    hf.save_pretrained(tmp_path)
    model = load(tmp_path, hf, "latent")
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["SparseMoE", "MLP", "SparseMoE"]
    prompt = PROMPTS[0]
    ours = prefill(model, prompt)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, expected, **TOL)


def test_kv_bytes_per_token_deepseek_v2_lite():
    """Real DeepSeek-V2-Lite: 27 layers, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, bf16."""
    lite = DeepseekV2Config(num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
                            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, hidden_size=2048)
    assert kv_bytes_per_token(lite, "latent") == 27 * (512 + 64) * 2  # 31,104
    assert kv_bytes_per_token(lite, "expanded") == 27 * 16 * (192 + 128) * 2  # 276,480


def test_bad_inputs_raise(checkpoint):
    folder, hf = checkpoint
    with pytest.raises(ValueError, match="attention_mode"):
        kv_bytes_per_token(hf.config, "paged")
    with pytest.raises(ValueError, match="attention_mode"):
        load(folder, hf, "paged")
    model = load(folder, hf, "latent")
    run = PagedRun(model, 1, 16)
    with pytest.raises(RuntimeError, match="need more than its 1 blocks of 16"):
        run.prefill([list(range(17))])  # past the sequence's pages
    ctx = run.runner.prepare(run.seqs, [2], True)
    with pytest.raises(ValueError, match="'expanded'"):
        model(ctx, PagedRun(load(folder, hf, "expanded"), 1, 16).runner.cache)
    v3_routing = copy.deepcopy(hf.config)
    v3_routing.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method"):
        DeepseekV2ForCausalLM(v3_routing, get_loader(folder, torch.float32, "cpu"), torch.float32, "cpu")


def dequantized_reference(dense_folder, quantized_folder, out_folder):
    """transformers model whose every linear is the dequantized weight stored in quantized_folder."""
    loader = get_loader(quantized_folder, torch.float32, "cpu")
    dense = Weights(dense_folder)
    tensors = {}
    for name in dense.names():
        tensor = dense.get_tensor(name)
        prefix = name.removesuffix(".weight")
        if tensor.ndim == 2 and name != "model.embed_tokens.weight":
            tensor = loader.get_linear(prefix).dequantize().float().contiguous()
        elif name.endswith(".bias"):  # AWQ/GPTQ store biases in fp16
            tensor = loader.get_linear(name.removesuffix(".bias"), bias=True).bias.float()
        tensors[name] = tensor
    save_file(tensors, str(out_folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(dense_folder / "config.json", out_folder / "config.json")
    return HFDeepseekV2.from_pretrained(out_folder).eval()


def quantize_linear_inputs_fp8(hf, monkeypatch):
    """Make transformers quantize each dense linear's input per token to e4m3 (scale = absmax /
    448), as fp8 checkpoints with activation_scheme "dynamic" are run. lm_head stays dense and the
    MoE router and experts are not nn.Linear (our fused_moe runs fp8 experts weight-only)."""
    quantized = {m.weight.data_ptr() for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear)
                 and name != "lm_head"}
    linear = torch.nn.functional.linear

    def linear_with_fp8_input(x, weight, bias=None):
        if weight.data_ptr() in quantized:
            scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448
            x = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return linear(x, weight, bias)
    monkeypatch.setattr(torch.nn.functional, "linear", linear_with_fp8_input)


QUANTIZED = {"awq": dict(group_size=32), "gptq": dict(group_size=32, sym=True, act_order=True),
             "fp8": dict(fp8_scheme="tensor")}


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
def test_quantized_matches_transformers_on_dequantized_weights(checkpoint, fmt, tmp_path, monkeypatch):
    folder, hf = checkpoint
    quantized = write_quantized(folder, tmp_path / fmt, fmt, **QUANTIZED[fmt])
    (tmp_path / "ref").mkdir()
    reference = dequantized_reference(folder, quantized, tmp_path / "ref")
    model = DeepseekV2ForCausalLM(hf.config, get_loader(quantized, torch.float32, "cpu"), torch.float32, "cpu")
    assert isinstance(model.layers[1].mlp.experts.down, FP8Weight if fmt == "fp8" else Int4Weight)  # experts quantized
    prompt = PROMPTS[0]
    ours = prefill(model, prompt)
    if fmt == "fp8":  # after our forward: the patch replaces F.linear for everyone
        quantize_linear_inputs_fp8(reference, monkeypatch)
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, expected, **TOL)


@pytest.mark.parametrize("capability, mode", [((7, 5), "expanded"), ((8, 0), "latent"), ((9, 0), "latent")])
def test_deepseek_attention_defaults_to_expanded_before_sm80(monkeypatch, capability, mode):
    """No latent-attention tile fits sm_75's 64 KB of shared memory (tests/aot/test_fit.py): DeepSeek expands there."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert default_attention_mode("cuda") == mode and default_attention_mode("cpu") == "latent"
