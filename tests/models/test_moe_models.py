"""Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 and GLM-4.5 against transformers' own models on tiny random checkpoints.

Each case batches a short prompt with a long one (3x the window and more where layers slide) and compares
each prompt with transformers run on it alone: prefill logits over interleaved pages, greedy tokens and
logprobs through the engine, and a run that the KV cache is too small for (preemption). Both sides compute
in float32 with the same weights, so they differ by summation order only (ATOL 1e-4 on O(1) logits);
initializer_range 0.1 keeps the router scores of different experts far apart, so no expert choice is a
near tie that summation order could flip. Quantized experts are compared with transformers on the
dequantized weights (tests/models/test_deepseek_v2.py does the same for V2).
"""
import copy
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from models.paged import PagedRun
from models.test_llama import hf_greedy
from models.test_llama_family import MAX_LEN, assert_batched_prefill_matches, build, prompts_for
from safetensors.torch import load_file, save_file
from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.models.moe import SparseMoE
from tritonq.quantize.writer import write_quantized
from tritonq.quant.weights import FP8Weight, Int4Weight

ATOL = 1e-4
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=MAX_LEN, rms_norm_eps=1e-6, initializer_range=0.1)
MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
           moe_intermediate_size=32)
CASES = {  # name: (transformers config, transformers model, config fields beyond COMMON)
    # Layer 1 dense (mlp_only_layers), renormalized top-3 of 8, biases on q/k/v/o, head_dim != hidden / heads.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
        attention_bias=True, head_dim=24)),
    # decoder_sparse_step 2: only layer 1 is MoE; unnormalized top-2; every layer slides (window < a page).
    "qwen3_moe_step2_window": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=2,
        use_sliding_window=True, sliding_window=6, tie_word_embeddings=True)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=False)),
    "mixtral_window": (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                               sliding_window=6)),
    # q LoRA, 8 experts in 4 groups of which 2 are kept, renormalized and scaled, 1 dense layer first.
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        MLA, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, n_shared_experts=1)),
    # One q_proj, half-split rope dims (rope_interleave false), one group, no renormalization, biases.
    "deepseek_v3_lite": (DeepseekV3Config, DeepseekV3ForCausalLM, dict(
        MLA, q_lora_rank=None, rope_interleave=False, n_routed_experts=6, num_experts_per_tok=2, n_group=1,
        topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False, first_k_dense_replace=0, n_shared_experts=2,
        attention_bias=True)),
    # GLM-4.5: V3's router (8 experts in 4 groups, 2 kept), a shared expert, 1 dense layer first, q/k norm, biases
    # on q/k/v, rope over half of each head (head_dim 32 != hidden / heads).
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, dict(
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1, n_shared_experts=1,
        attention_bias=True, use_qk_norm=True, head_dim=32, partial_rotary_factor=0.5)),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def write_checkpoint(folder, name: str, seed: int = 0, **overrides):
    """Save a tiny random model of CASES[name] with the byte tokenizer; returns the transformers model. Biases,
    norm weights and DeepSeek-V3's e_score_correction_bias are random, so those paths matter."""
    config_cls, model_cls, fields = CASES[name]
    tokenizer = byte_tokenizer()
    config = config_cls(**{"vocab_size": len(tokenizer), **COMMON, **fields, **overrides},
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for key, p in [*model.named_parameters(), *model.named_buffers()]:
            if key.endswith("e_score_correction_bias"):  # ~ the spread of the sigmoid scores: moves the choice
                p.normal_(0, 0.1)
            elif key.endswith("bias") or "norm" in key:
                p.normal_(0, 0.5 if "bias" in key else 1.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def assert_greedy_matches(folder, hf, prompts, n=12, **engine_options):
    """Batched generation of n greedy tokens; each prompt's tokens and logprobs vs transformers alone.
    Returns our tritonq.Model."""
    ours = tritonq.load(folder, max_num_seqs=len(prompts), max_seq_len=MAX_LEN, **engine_options)
    eos = ours.tokenizer.eos_token_id
    expected = [hf_greedy(copy.deepcopy(hf), p, n, eos) for p in prompts]
    assert max(len(t) for t, _ in expected) == n  # not all stopped early at EOS
    got = ours.generate(prompts, max_new_tokens=n, return_dict=True)
    for (tokens, logprobs), got_tokens, got_logprobs in zip(expected, got.token_ids, got.logprobs):
        assert got_tokens == tokens
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=ATOL, rtol=0)
    return ours


def moe_layers(model) -> list[bool]:
    return [isinstance(layer.mlp, SparseMoE) for layer in model.layers]


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_and_greedy_match_transformers(tmp_path, name):
    hf = write_checkpoint(tmp_path, name)
    prompts = prompts_for(hf.config)
    ours = build(tmp_path)
    expected_moe = {"qwen3_moe": [True, False, True], "qwen3_moe_step2_window": [False, True, False],
                    "deepseek_v3": [False, True, True], "glm4_moe": [False, True, True]}.get(name, [True, True, True])
    assert moe_layers(ours) == expected_moe
    assert_batched_prefill_matches(ours, hf, prompts)
    assert_greedy_matches(tmp_path, hf, prompts)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_lite"])
def test_deepseek_v3_expanded_attention_matches_transformers(tmp_path, name):
    """V3 in MLA's other cache mode (the latent one is the CPU default, run above)."""
    hf = write_checkpoint(tmp_path, name)
    assert_batched_prefill_matches(build(tmp_path, attention_mode="expanded"), hf, prompts_for(hf.config))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral_window", "deepseek_v3", "glm4_moe"])
def test_preempted_and_chunked_requests_give_transformers_tokens(tmp_path, name):
    """Four prompts (two short, two long) in a KV cache of 6 blocks with an 8-token step budget: long prompts
    are prefilled in chunks beside running decodes, and sequences are preempted and resumed; every request
    still gives transformers' greedy tokens for its prompt alone."""
    hf = write_checkpoint(tmp_path, name)
    per_block = build(tmp_path).kv_layout.bytes_per_token(torch.float32) * 16
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 30, 3, 26)]
    ours = assert_greedy_matches(tmp_path, hf, prompts, kv_cache_gb=6 * per_block / 2 ** 30,
                                 max_num_batched_tokens=8)
    assert ours.engine.block_manager.num_blocks == 6
    assert ours.engine.scheduler.num_preemptions > 0


def test_glm4_moe_triton_kernels_match_transformers(tmp_path, monkeypatch):
    """GLM-4.5 (partial rotary, grouped sigmoid routing, shared expert) through the Triton kernels (interpreter),
    small shapes: a batched prefill and 4 greedy tokens of each prompt equal transformers alone."""
    hf = write_checkpoint(tmp_path, "glm4_moe", hidden_size=32, intermediate_size=48, head_dim=16,
                          moe_intermediate_size=16, num_hidden_layers=2)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 13)]
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    assert_batched_prefill_matches(build(tmp_path), hf, prompts)
    assert_greedy_matches(tmp_path, hf, prompts, n=4)


def test_deepseek_v3_router_bias_only_chooses(tmp_path):
    """e_score_correction_bias moves which experts are chosen but not their weights: with the bias set to
    zero the logits change (the choice did), and transformers agrees in both cases (checked above with it)."""
    hf = write_checkpoint(tmp_path / "biased", "deepseek_v3")
    config = json.loads((tmp_path / "biased" / "config.json").read_text())
    tensors = load_file(tmp_path / "biased" / "model.safetensors")
    for key in tensors:
        if key.endswith("e_score_correction_bias"):
            tensors[key] = torch.zeros_like(tensors[key])
    (tmp_path / "plain").mkdir()
    save_file(tensors, str(tmp_path / "plain" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    prompt = prompts_for(hf.config)[1]
    biased, plain = (PagedRun(build(tmp_path / d), 1, MAX_LEN).prefill([prompt])[0] for d in ("biased", "plain"))
    assert (biased - plain).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_mtp_layer_is_left_unread_with_a_warning(tmp_path, name):
    """A checkpoint with DeepSeek-V3's / GLM-4.5's multi-token-prediction layer (model.layers.<num_hidden_layers>.*)
    loads, warns naming those tensors, and gives the same logits; a tensor of any other extra layer is refused."""
    hf = write_checkpoint(tmp_path, name)
    tensors = load_file(tmp_path / "model.safetensors")
    L = hf.config.num_hidden_layers
    mtp = {f"model.layers.{L}.{k.split('.', 3)[3]}": v.clone()  # a copy of layer 1 as the MTP's decoder layer
           for k, v in tensors.items() if k.startswith("model.layers.1.")}
    mtp.update({f"model.layers.{L}.eh_proj.weight": torch.randn(64, 128), f"model.layers.{L}.enorm.weight":
                torch.ones(64), f"model.layers.{L}.hnorm.weight": torch.ones(64),
                f"model.layers.{L}.shared_head.norm.weight": torch.ones(64)})
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    with pytest.warns(UserWarning, match=rf"multi-token-prediction.*model\.layers\.{L}\.eh_proj\.weight"):
        model = build(tmp_path)
    assert_batched_prefill_matches(model, hf, prompts_for(hf.config))
    config["num_nextn_predict_layers"] = 0  # now nothing explains layer L: refused, naming it
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"not used by any module.*model\.layers\.{L}\."):
        build(tmp_path)


@pytest.mark.parametrize("field, value, match", [
    ("topk_method", "group_limited_greedy", "topk_method"), ("scoring_func", "softmax", "scoring_func"),
    ("hidden_act", "gelu", "hidden_act")])
def test_unsupported_config_fields_are_refused(tmp_path, field, value, match):
    write_checkpoint(tmp_path, "deepseek_v3" if field != "hidden_act" else "mixtral_window")
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        tritonq.load(tmp_path, max_num_seqs=1, max_seq_len=32)


@pytest.mark.parametrize("field, value, match", [
    ("hidden_act", "gelu", "hidden_act"), ("n_group", 3, "n_group=3"), ("topk_group", 5, "topk_group=5"),
    ("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.3},
     "partial_rotary_factor=0.3")])
def test_glm4_moe_bad_config_is_refused_naming_the_key(tmp_path, field, value, match):
    """The key, what it says, what was expected: experts that do not split into n_group groups, more groups kept
    than there are, rotary dims that are odd (32 * 0.3 = 9), an activation the experts do not run."""
    write_checkpoint(tmp_path, "glm4_moe")
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        tritonq.load(tmp_path, max_num_seqs=1, max_seq_len=32)


# ---- quantized experts: each checkpoint vs transformers on its dequantized weights -------------------------

def reference_from_dequantized(folder, dequantized: dict[str, torch.Tensor], out):
    """transformers' model for quantized checkpoint `folder` in which every quantized module `prefix` holds
    dequantized[prefix] (W [N, K]) and every other tensor is as stored (biases AWQ / GPTQ keep in fp16)."""
    stored = load_file(folder / "model.safetensors")
    tensors = {k: v.float() for k, v in stored.items()
               if k.rpartition(".")[0] not in dequantized or k.endswith(".bias")}
    tensors.update({f"{prefix}.weight": w.float().contiguous() for prefix, w in dequantized.items()})
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    config_cls, model_cls, _ = next(c for c in CASES.values() if c[0].model_type == config["model_type"])
    return model_cls.from_pretrained(out, dtype=torch.float32).eval()


def module_prefixes(folder) -> set[str]:
    return {k.rpartition(".")[0] for k in load_file(folder / "model.safetensors")}


def assert_experts_quantized(model, kind) -> None:
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    assert moe and all(isinstance(m.experts.gate_up, kind) and isinstance(m.experts.down, kind) for m in moe)


def fp8_input(module, args):
    """Forward pre-hook: round a linear's input per token to e4m3 (scale = absmax / 448), as fp8 checkpoints
    with activation_scheme "dynamic" run (and as our fp8 GEMM does)."""
    x = args[0]
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448
    return ((x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale,)


def round_inputs_to_fp8(hf, prefixes: set[str]) -> None:
    """Make transformers round the input of each nn.Linear named in prefixes to fp8 (`fp8_input`; hooks survive
    the deepcopy each comparison makes). Experts are 3-D parameters in transformers 5, not nn.Linear: they stay
    weight-only, as our fused_moe runs fp8 experts."""
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name in prefixes:
            module.register_forward_pre_hook(fp8_input)


WRITER = {  # name: (case, format, options) written by tritonq's own writer (tritonq.quantize)
    "qwen3_moe_awq": ("qwen3_moe", "awq", {"group_size": 32}),
    "mixtral_gptq_act_order": ("mixtral_window", "gptq", {"group_size": 32, "sym": True, "act_order": True}),
    "deepseek_v3_gptq_8bit": ("deepseek_v3", "gptq", {"group_size": 32, "bits": 8}),
    "qwen2_moe_fp8_tensor": ("qwen2_moe", "fp8", {"fp8_scheme": "tensor"}),
    "glm4_moe_awq": ("glm4_moe", "awq", {"group_size": 32}),
}


@pytest.mark.parametrize("name", list(WRITER))
def test_writer_quantized_experts_match_transformers_on_dequantized_weights(tmp_path, name):
    """Per-expert AWQ / GPTQ / fp8 linears (experts.N.gate_proj.qweight ...) are stacked at load into the
    fused-MoE layout; our prefill logits and greedy tokens equal transformers on the dequantized weights
    (fp8: transformers' dense linears also round their inputs per token to e4m3, as our fp8 GEMM does; the
    experts run weight-only on both sides)."""
    case, fmt, options = WRITER[name]
    write_checkpoint(tmp_path / "dense", case)
    folder = write_quantized(tmp_path / "dense", tmp_path / name, fmt, **options)
    loader = get_loader(folder, torch.float32, "cpu")
    dequantized = {p: loader.get_linear(p).dequantize() for p in module_prefixes(folder) if loader.is_quantized(p)}
    reference = reference_from_dequantized(folder, dequantized, tmp_path / "reference")
    ours = build(folder)
    assert_experts_quantized(ours, FP8Weight if fmt == "fp8" else Int4Weight)
    prompts = prompts_for(reference.config)
    if fmt == "fp8":
        round_inputs_to_fp8(reference, set(dequantized))
    assert_batched_prefill_matches(ours, reference, prompts)
    assert_greedy_matches(folder, reference, prompts, n=8)


# ---- quantized experts from the real packers, against the packer's own dequantization ----------------------

def linear_tree(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree holding an nn.Linear (no bias) at every 2-D `<prefix>.weight` of a checkpoint (embeddings
    aside): a checkpoint's per-expert layout (experts.N.gate_proj ...), which packers quantize module by module
    (transformers 5 keeps experts as 3-D parameters, which no Linear-targeting packer sees)."""
    root = torch.nn.Module()
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or t.ndim != 2 or prefix.endswith("embed_tokens"):
            continue
        *parents, last = prefix.split(".")
        module = root
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        linear = torch.nn.Linear(t.shape[1], t.shape[0], bias=False)
        linear.weight.data = t.clone()
        module.add_module(last, linear)
    return root


def ct_moe_checkpoint(dense, folder, weights: dict, fmt: str, ignore: list[str]) -> dict[str, torch.Tensor]:
    """Quantize checkpoint `dense` module by module with compressed-tensors (its apply_quantization_config,
    min-max qparams, ModelCompressor, as llm-compressor saves) into `folder`; returns compressed-tensors' own
    decompression (its compressor's `decompress`) of every module it quantized, by prefix."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from formats.test_real_packers import ct_min_max_qparams
    stored = load_file(dense / "model.safetensors")
    tree = linear_tree(stored)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    apply_quantization_config(tree, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore),
                              show_progress=False)
    ct_min_max_qparams(tree)
    compressor = ModelCompressor.from_pretrained_model(tree, quantization_format=fmt)
    compressor.compress_model(tree)
    compressed = {k: v.contiguous() for k, v in tree.state_dict().items()}
    folder.mkdir()
    replaced = {k for k in stored
                if k in compressed or (k.endswith(".weight") and k[:-7] + ".weight_scale" in compressed)}
    save_file({**{k: v for k, v in stored.items() if k not in replaced}, **compressed},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    for path in dense.iterdir():  # config.json and the tokenizer files
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    compressor.update_config(folder)
    quantized = {k.rpartition(".")[0] for k in compressed if k.endswith(".weight_scale")}
    decompressor = BaseCompressor.get_value_from_registry(fmt)
    return {p: decompressor.decompress({k.rpartition(".")[2]: v for k, v in compressed.items()
                                        if k.rpartition(".")[0] == p}, scheme)["weight"].float() for p in quantized}


INT = dict(type="int", symmetric=True)
FP8_WEIGHTS = dict(num_bits=8, type="float", symmetric=True)
COMPRESSED_TENSORS = {  # name: (case, weights, format, ignore); every scheme weight-only (input_activations null)
    "qwen3_moe_w4a16": ("qwen3_moe", dict(INT, num_bits=4, strategy="group", group_size=32), "pack-quantized",
                        ["lm_head", "re:.*mlp.gate$"]),
    "qwen2_moe_w4a16_asym": ("qwen2_moe", dict(INT, num_bits=4, symmetric=False, strategy="group", group_size=32),
                             "pack-quantized", ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert.*"]),
    "mixtral_w8a16": ("mixtral_window", dict(INT, num_bits=8, strategy="channel"), "pack-quantized",
                      ["lm_head", "re:.*block_sparse_moe.gate$"]),
    "deepseek_v3_fp8_block": ("deepseek_v3", dict(FP8_WEIGHTS, strategy="block", block_structure=[32, 32]),
                              "float-quantized", ["lm_head", "re:.*mlp.gate$", "re:.*shared_experts.*"]),
    "deepseek_v3_fp8_channel": ("deepseek_v3", dict(FP8_WEIGHTS, strategy="channel"), "float-quantized",
                                ["lm_head", "re:.*mlp.gate$"]),
    "qwen3_moe_fp8_tensor": ("qwen3_moe", dict(FP8_WEIGHTS, strategy="tensor"), "float-quantized",
                             ["lm_head", "re:.*mlp.gate$"]),
    "glm4_moe_fp8_block": ("glm4_moe", dict(FP8_WEIGHTS, strategy="block", block_structure=[32, 32]),
                           "float-quantized", ["lm_head", "re:.*mlp.gate$"]),
}


@pytest.mark.parametrize("name", list(COMPRESSED_TENSORS))
def test_compressed_tensors_experts_match_its_own_dequantization(tmp_path, name):
    """compressed-tensors W4A16 / W8A16 / FP8 (tensor, channel, block) experts, with `ignore` lists that keep
    the router (and shared experts) dense: prefill and greedy tokens equal transformers holding
    compressed-tensors' own decompression of every module."""
    case, weights, fmt, ignore = COMPRESSED_TENSORS[name]
    write_checkpoint(tmp_path / "dense", case)
    dequantized = ct_moe_checkpoint(tmp_path / "dense", tmp_path / name, weights, fmt, ignore)
    assert not [p for p in dequantized if p.endswith(".gate")]  # the ignore list kept every router dense
    assert any(".experts." in p for p in dequantized)
    if any("shared_expert" in entry for entry in ignore):
        assert not [p for p in dequantized if "shared_expert" in p]
    reference = reference_from_dequantized(tmp_path / name, dequantized, tmp_path / "reference")
    ours = build(tmp_path / name)
    assert_experts_quantized(ours, FP8Weight if weights["type"] == "float" else Int4Weight)
    prompts = prompts_for(reference.config)
    assert_batched_prefill_matches(ours, reference, prompts)
    assert_greedy_matches(tmp_path / name, reference, prompts, n=8)


def awq_moe_checkpoint(dense, folder, group_size: int, modules_to_not_convert: list[str] | None
                       ) -> dict[str, torch.Tensor]:
    """Pack every decoder linear of checkpoint `dense` whose name contains no entry of modules_to_not_convert
    (AutoAWQ's own rule, `exclude_layers_to_not_quantize`) with AutoAWQ (its pseudo-quantizer's scales / zeros,
    WQLinear_GEMM's packer) into `folder`; returns AutoAWQ's own dequantization (`dequantize_gemm`) of each
    packed module, by prefix."""
    from formats.test_real_packers import awq_imports
    WQLinear_GEMM, AwqQuantizer, dequantize_gemm = awq_imports()
    tensors = load_file(dense / "model.safetensors")
    quantizer = SimpleNamespace(w_bit=4, group_size=group_size, zero_point=True)
    dequantized = {}
    for name in sorted(tensors):
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or tensors[name].ndim != 2 or not prefix.startswith("model.layers.") \
                or any(entry in prefix for entry in modules_to_not_convert or []):
            continue
        linear = torch.nn.Linear(tensors[name].shape[1], tensors[name].shape[0], bias=False)
        # as AutoAWQ's _apply_quant: the layer takes the pseudo-quantized weight, then is packed
        linear.weight.data, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(quantizer, tensors.pop(name).float())
        packed = WQLinear_GEMM.from_linear(linear, 4, group_size, False, scales.t().contiguous(),
                                           zeros.t().contiguous())
        tensors |= {f"{prefix}.qweight": packed.qweight, f"{prefix}.qzeros": packed.qzeros,
                    f"{prefix}.scales": packed.scales}
        # fed the fp16 scales as float32 (exact), so that it does not round W to fp16
        dequantized[prefix] = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, group_size).t()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for path in dense.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": modules_to_not_convert}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


AUTOAWQ = {  # case: (config overrides, AutoAWQ's modules_to_not_convert for that architecture)
    # AutoAWQ's Qwen3-MoE model names no exclusion: the router is packed too (32 experts: AutoAWQ packs N in
    # multiples of 32, and so are the attention widths with head_dim 16).
    "qwen3_moe": (dict(num_experts=32, head_dim=16), None),
    "mixtral_window": (dict(head_dim=16), ["gate"]),  # awq/models/mixtral.py: the router stays dense
}


@pytest.mark.parametrize("case", list(AUTOAWQ))
def test_autoawq_experts_match_its_own_dequantization(tmp_path, case):
    """Experts (and attention, and Qwen3-MoE's router) packed by AutoAWQ's GEMM packer under AutoAWQ's own
    exclusion rules: prefill and greedy tokens equal transformers on AutoAWQ's own dequantization."""
    overrides, not_convert = AUTOAWQ[case]
    write_checkpoint(tmp_path / "dense", case, **overrides)
    dequantized = awq_moe_checkpoint(tmp_path / "dense", tmp_path / "awq", 32, not_convert)
    assert any(p.endswith(".gate") for p in dequantized) == (not_convert is None)
    reference = reference_from_dequantized(tmp_path / "awq", dequantized, tmp_path / "reference")
    ours = build(tmp_path / "awq")
    assert_experts_quantized(ours, Int4Weight)
    prompts = prompts_for(reference.config)
    assert_batched_prefill_matches(ours, reference, prompts)
    assert_greedy_matches(tmp_path / "awq", reference, prompts, n=8)


def gptqmodel_moe_checkpoint(dense, folder, dynamic: dict, bits: int = 4, group_size: int = 32
                             ) -> dict[str, torch.Tensor]:
    """A GPTQ checkpoint of `dense` laid out as GPTQModel writes one (v1 zeros minus 0x11.. per word, its meta
    quantizer named) with `dynamic` per-module overrides ("-:regex" dense, "+:regex" other bits / group_size),
    built from the published format with test_real_packers' independent quantizer; routers stay dense (GPTQModel's
    MoE definitions never quantize them). Returns the independent dequantization of each packed module."""
    import re

    from formats.test_real_packers import dequantize_gptq, gptq_layer, pack_fields
    tensors = load_file(dense / "model.safetensors")
    dequantized = {}
    for name in sorted(tensors):
        prefix, _, leaf = name.rpartition(".")
        if leaf != "weight" or tensors[name].ndim != 2 or not prefix.startswith("model.layers.") \
                or prefix.endswith(".gate"):
            continue
        rule = next((key for key in dynamic if re.match(key[2:], prefix)), None)
        if rule is not None and rule.startswith("-:"):
            continue
        p = {"bits": bits, "group_size": group_size, **(dynamic[rule] if rule else {})}
        q, zeros, scales = gptq_layer(tensors.pop(name).float(), p["bits"], p["group_size"], seed=len(dequantized))
        ones = sum(1 << (p["bits"] * j) for j in range(32 // p["bits"]))
        words = (pack_fields(zeros, p["bits"]).to(torch.int64) - ones) & 0xFFFFFFFF
        tensors |= {f"{prefix}.qweight": pack_fields(q.T, p["bits"]).T.contiguous(),
                    f"{prefix}.qzeros": (words - (words >= 2**31) * 2**32).to(torch.int32), f"{prefix}.scales": scales,
                    f"{prefix}.g_idx": torch.zeros(q.shape[0], dtype=torch.int32) if p["group_size"] == -1 else
                    (torch.arange(q.shape[0]) // p["group_size"]).to(torch.int32)}
        dequantized[prefix] = dequantize_gptq(q, zeros, scales, p["group_size"])
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for path in dense.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": False,
        "checkpoint_format": "gptq", "meta": {"quantizer": ["gptqmodel:4.0.0"]}, "dynamic": dynamic}
    (folder / "config.json").write_text(json.dumps(config))
    return dequantized


GPTQMODEL_DYNAMIC = {  # case: dynamic
    # attention 8-bit per channel, experts 4-bit group 32, the dense MLP of layer 1 left dense
    "qwen3_moe": {r"+:.*self_attn\..*": {"bits": 8, "group_size": -1}, r"-:.*layers\.1\.mlp\..*": {}},
    # the shared expert (and its gate) left dense, experts 8-bit
    "qwen2_moe": {r"-:.*shared_expert.*": {}, r"+:.*experts\..*": {"bits": 8}},
}


@pytest.mark.parametrize("case", list(GPTQMODEL_DYNAMIC))
def test_gptqmodel_dynamic_overrides_on_experts(tmp_path, case):
    """GPTQModel `dynamic` per-module overrides across a MoE model (other bits / group size for some modules, others
    left dense): every module is read with its own parameters, and the model equals transformers on the
    independent dequantization."""
    write_checkpoint(tmp_path / "dense", case)
    dequantized = gptqmodel_moe_checkpoint(tmp_path / "dense", tmp_path / "gptq", GPTQMODEL_DYNAMIC[case])
    reference = reference_from_dequantized(tmp_path / "gptq", dequantized, tmp_path / "reference")
    ours = build(tmp_path / "gptq")
    assert_experts_quantized(ours, Int4Weight)
    attention, moe = ours.layers[0].self_attn.qkv_proj.weight, ours.layers[0].mlp
    assert attention.bits == (8 if case == "qwen3_moe" else 4) and moe.experts.gate_up.bits == (4 if case == "qwen3_moe" else 8)
    prompts = prompts_for(reference.config)
    assert_batched_prefill_matches(ours, reference, prompts)
    assert_greedy_matches(tmp_path / "gptq", reference, prompts, n=8)


def test_experts_quantized_differently_within_a_layer_are_refused_naming_it(tmp_path):
    """One fused kernel runs all experts of a layer: a `dynamic` rule giving expert 0 other bits is refused, naming
    the layer and the sizes found."""
    write_checkpoint(tmp_path / "dense", "qwen3_moe")
    dynamic = {r"+:.*layers\.2\.mlp\.experts\.0\..*": {"bits": 8}}
    gptqmodel_moe_checkpoint(tmp_path / "dense", tmp_path / "gptq", dynamic)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts: .*"
                                         r"\(bits, group_size\) \[\(4, 32\), \(8, 32\)\]"):
        build(tmp_path / "gptq")
