"""Gemma 3 (gemma3_text) against transformers' Gemma3ForCausalLM on tiny random checkpoints.

Every check batches a short prompt with a long one (3x the window and more) and compares each prompt with
transformers run on it alone. Both sides compute in float32 with the same weights, so logits agree to float32
rounding over three layers: ATOL 1e-4 on O(1) logits (as tests/models/test_llama_family.py). Norm offsets and
biases are random (the (1 + weight) norms and biases matter), sliding and full layers get distinct rope bases (and
the full ones linear scaling), query_pre_attn_scalar differs from head_dim, so each Gemma difference changes the
logits. Quantized checkpoints (tritonq's writer) are compared with transformers on the dequantized weights.
"""
import json

import pytest
import torch
from models.test_llama import dequantized_transformers_model, save_with_random_biases_and_norms
from models.test_llama_family import MAX_LEN, assert_batched_prefill_matches, assert_greedy_matches, build, prompts_for
from safetensors.torch import load_file
from parallel.test_tensor_parallel import run_on_ranks
from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.quantize.writer import write_quantized

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=MAX_LEN, rms_norm_eps=1e-6)
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
CASES = {
    # layers sliding, full, sliding (sliding_window_pattern 2); window 6 < a page; tied; softcap 3 on O(1) logits.
    "tied_window6_softcap": dict(sliding_window=6, sliding_window_pattern=2, head_dim=32, query_pre_attn_scalar=24,
                                 final_logit_softcapping=3.0, attention_bias=True, rope_parameters=ROPE),
    # explicit layer_types, window 20 > a page, untied lm_head, no softcap, head_dim 16 = hidden / heads.
    "untied_window20": dict(sliding_window=20, head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=False,
                            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                            rope_parameters=ROPE),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def write_checkpoint(folder, name: str, seed: int = 0, **overrides):
    """A tiny random Gemma3ForCausalLM of CASES[name] with the byte tokenizer; returns the transformers model."""
    tokenizer = byte_tokenizer()
    fields = json.loads(json.dumps(CASES[name]))  # the config class keeps (and edits) the dicts it is given
    config = Gemma3TextConfig(**{**COMMON, **fields, **overrides}, vocab_size=len(tokenizer),
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return save_with_random_biases_and_norms(Gemma3ForCausalLM(config).eval(), tokenizer, folder)


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_and_greedy_match_transformers(tmp_path, name):
    hf = write_checkpoint(tmp_path, name)
    prompts = prompts_for(hf.config)
    ours = build(tmp_path)
    assert [layer.self_attn.window for layer in ours.layers] == [
        hf.config.sliding_window if t == "sliding_attention" else 0 for t in hf.config.layer_types]
    assert len(set(hf.config.layer_types)) == 2  # both kinds of layer run
    assert_batched_prefill_matches(ours, hf, prompts)
    assert_greedy_matches(tmp_path, hf, prompts)


def test_triton_kernels_match_transformers(tmp_path, monkeypatch):
    """Through the Triton kernels (interpreter), small shapes: prefill of a batch over sliding and full layers and
    4 greedy tokens of each prompt equal transformers alone."""
    hf = write_checkpoint(tmp_path, "tied_window6_softcap", hidden_size=32, intermediate_size=64, head_dim=8,
                          query_pre_attn_scalar=8, sliding_window=4, num_hidden_layers=2)
    prompts = prompts_for(hf.config)  # 5 and 15 tokens, window 4
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    assert_batched_prefill_matches(build(tmp_path), hf, prompts)
    assert_greedy_matches(tmp_path, hf, prompts, n=4)


def test_preempted_and_chunked_requests_give_transformers_tokens(tmp_path):
    """Four prompts in a KV cache of 6 blocks with an 8-token step budget: long prompts are prefilled in chunks
    beside running decodes, sequences are preempted and resumed; each gives transformers' tokens for it alone."""
    hf = write_checkpoint(tmp_path, "tied_window6_softcap")
    per_block = build(tmp_path).kv_layout.bytes_per_token(torch.float32) * 16
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 30, 3, 26)]
    assert_greedy_matches(tmp_path, hf, prompts, n=12, kv_cache_gb=6 * per_block / 2 ** 30, max_num_batched_tokens=8)


@pytest.mark.parametrize("fmt, options", [("awq", {"group_size": 32}), ("gptq", {"group_size": 32, "sym": True})])
def test_quantized_matches_transformers_on_dequantized_weights(tmp_path, fmt, options):
    hf = write_checkpoint(tmp_path / "dense", "tied_window6_softcap")
    write_quantized(tmp_path / "dense", tmp_path / fmt, fmt, **options)
    hf = dequantized_transformers_model(hf, tmp_path / fmt)
    stored = load_file(tmp_path / fmt / "model.safetensors")
    with torch.no_grad():  # biases as stored (fp16 in AWQ / GPTQ files)
        for key, param in hf.named_parameters():
            if key.endswith(".bias"):
                param.copy_(stored[key].float())
    prompts = prompts_for(hf.config)
    assert_batched_prefill_matches(build(tmp_path / fmt), hf, prompts)
    assert_greedy_matches(tmp_path / fmt, hf, prompts, n=8)


def test_image_text_checkpoint_runs_its_language_model(tmp_path):
    """A gemma3 (image-text) checkpoint: its language model (language_model.model.*, settings in text_config) equals
    transformers' Gemma3ForConditionalGeneration on text prompts; the vision tower and projector are named in one
    warning and left unread. A final logit softcap there is refused (that transformers class ignores it)."""
    tokenizer = byte_tokenizer()
    text = {**COMMON, **json.loads(json.dumps(CASES["tied_window6_softcap"])), "vocab_size": len(tokenizer),
            "final_logit_softcapping": None}
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=257,
                          boi_token_index=255, eoi_token_index=256, eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    hf = save_with_random_biases_and_norms(Gemma3ForConditionalGeneration(config).eval(), tokenizer, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma3"
    with pytest.warns(UserWarning, match=r"vision tower.*vision_tower\.embeddings\.patch_embedding\.weight"):
        ours = build(tmp_path)
    prompts = prompts_for(hf.config.text_config)
    assert_batched_prefill_matches(ours, hf, prompts)
    assert_greedy_matches(tmp_path, hf, prompts, n=8)
    config = json.loads((tmp_path / "config.json").read_text())
    config["text_config"]["final_logit_softcapping"] = 30.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="text_config.final_logit_softcapping=30.0"):
        build(tmp_path)


@pytest.mark.parametrize("field, value, match", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True"),
    ("hidden_activation", "relu", "hidden_activation='relu'"),
    ("layer_types", ["sliding_attention", "linear_attention", "full_attention"], "layer_types=")])
def test_bad_config_is_refused_naming_the_key(tmp_path, field, value, match):
    write_checkpoint(tmp_path, "tied_window6_softcap")
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        build(tmp_path)


# ---- tensor parallel: 2 ranks (4 query heads, 2 KV heads, vocabulary 258 split by rows) vs one process -------

PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 1, 250, 9, 30, 31, 2, 8, 77], [64, 65, 66, 67]]


def tp_steps(model: tritonq.Model) -> dict:
    """Each prompt's prefill logits and greedy tokens (decoded through the paged cache); ranks and one process."""
    greedy = model.generate(PROMPTS, max_new_tokens=5, return_dict=True)
    return {"logits": [model.engine.prompt_logits(p) for p in PROMPTS],
            "greedy": None if greedy is None else greedy.token_ids}


def test_two_ranks_match_single_process(tmp_path):
    """Heads, the GeGLU intermediate size and the vocabulary split over 2 ranks (q / k norms replicated): the same
    logits as one process to float32 rounding of the regrouped sums (ATOL 1e-4), the same greedy tokens."""
    write_checkpoint(tmp_path / "gemma", "tied_window6_softcap", sliding_window=4)
    single = tp_steps(tritonq.load(tmp_path / "gemma", device="cpu", dtype=torch.float32, max_num_seqs=2,
                                   max_seq_len=24))
    ranks = run_on_ranks(tp_steps, {"gemma": tmp_path / "gemma"}, tmp_path / "out")
    for rank in ranks:
        for got, expected in zip(rank["gemma"]["logits"], single["logits"], strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert ranks[0]["gemma"]["greedy"] == single["greedy"]
    assert ranks[1]["gemma"]["greedy"] is None  # only rank 0 returns generated text
