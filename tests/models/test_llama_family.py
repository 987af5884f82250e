"""Mistral (sliding window), Qwen2 and Qwen3 against transformers' MistralForCausalLM,
Qwen2ForCausalLM and Qwen3ForCausalLM, and dynamic rope per sequence, on tiny random checkpoints.

Every check batches a short prompt with a long one (sliding window: 3x the window and more) and
compares each prompt with transformers run on it alone. Dense checkpoints compute in float32 on
both sides with the same weights: logits agree to float32 rounding over a few layers, ATOL 1e-4
(logits are O(1)); quantized ones are compared with transformers on the dequantized weights and
the biases as stored (AWQ / GPTQ files hold them in fp16).
The torch references run the kernels except in the one interpreter test (the Triton kernels).
"""
import copy
import json

import pytest
import torch
from models.paged import PagedRun
from models.test_llama import dequantized_transformers_model, hf_greedy, save_with_random_biases_and_norms
from safetensors.torch import load_file
from transformers import (AutoConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.models import model_class
from tritonq.models.common import RopeTables, StepContext
from tritonq.quantize.writer import write_quantized

ATOL = 1e-4
MAX_LEN = 128  # rope tables / engine max_seq_len of every model here
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=MAX_LEN, rms_norm_eps=1e-6)
CASES = {  # name: (transformers config, transformers model, config fields beyond COMMON)
    "mistral_window6": (MistralConfig, MistralForCausalLM, dict(sliding_window=6)),  # window < a 16-token page
    "mistral_window20": (MistralConfig, MistralForCausalLM, dict(sliding_window=20)),  # window > a page
    # Layers 1 and 2 slide (i >= max_window_layers), layer 0 attends to everything.
    "qwen2_tied_window": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, use_sliding_window=True,
                                                              sliding_window=6, max_window_layers=1)),
    "qwen2_untied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3_untied_bias_window": (Qwen3Config, Qwen3ForCausalLM, dict(
        tie_word_embeddings=False, attention_bias=True, head_dim=24, use_sliding_window=True, sliding_window=6,
        max_window_layers=1)),  # head_dim 24 != hidden / heads
    "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=True, head_dim=16)),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def write_checkpoint(folder, name: str, seed: int = 0, **overrides):
    """Save a tiny random model of CASES[name] (fields overridden by overrides) with the byte tokenizer;
    returns the transformers model. Biases and norm weights are random, so those paths matter."""
    config_cls, model_cls, fields = CASES[name]
    tokenizer = byte_tokenizer()
    config = config_cls(**{**COMMON, **fields, **overrides}, vocab_size=len(tokenizer),
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return save_with_random_biases_and_norms(model_cls(config).eval(), tokenizer, folder)


def build(folder, **options):
    """Our model for a checkpoint folder, every stored tensor checked as read (as load() does); options: the model
    class's own (attention_mode, ...)."""
    config = AutoConfig.from_pretrained(folder)
    loader = get_loader(folder, torch.float32, "cpu")
    model = model_class(config.model_type)(config, loader, torch.float32, "cpu", max_seq_len=MAX_LEN, **options)
    loader.finish()
    return model


def prompts_for(config) -> list[list[int]]:
    """A short prompt and a long one: 3x the window plus a few tokens where the config slides."""
    window = getattr(config, "sliding_window", None)
    long = 3 * window + 3 if window else 40
    return [torch.randint(0, 256, (5,)).tolist(), torch.randint(0, 256, (long,)).tolist()]


def assert_batched_prefill_matches(ours, hf, prompts, atol=ATOL):
    """All prompts in one prefill step over interleaved pages; each prompt's logits vs transformers alone."""
    got = PagedRun(ours, len(prompts), MAX_LEN).prefill(prompts)
    for prompt, logits in zip(prompts, got):
        with torch.no_grad():
            expected = copy.deepcopy(hf)(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, atol=atol, rtol=0)


def assert_greedy_matches(folder, hf, prompts, n=16, atol=ATOL, **engine_options):
    """Batched generation of n greedy tokens; each prompt's tokens and logprobs vs transformers alone."""
    ours = tritonq.load(folder, max_num_seqs=len(prompts), max_seq_len=MAX_LEN, **engine_options)
    eos = ours.tokenizer.eos_token_id
    expected = [hf_greedy(copy.deepcopy(hf), p, n, eos) for p in prompts]  # a fresh rope state per run
    assert max(len(t) for t, _ in expected) == n  # not all stopped early at EOS
    got = ours.generate(prompts, max_new_tokens=n, return_dict=True)
    for (tokens, logprobs), got_tokens, got_logprobs in zip(expected, got.token_ids, got.logprobs):
        assert got_tokens == tokens
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(logprobs), atol=atol, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_and_greedy_match_transformers(tmp_path, name):
    hf = write_checkpoint(tmp_path, name)
    prompts = prompts_for(hf.config)
    assert_batched_prefill_matches(build(tmp_path), hf, prompts)
    assert_greedy_matches(tmp_path, hf, prompts)


def test_window_with_chunked_prefill_matches_transformers(tmp_path):
    """A step budget of 8 tokens prefills the 21-token prompt in chunks next to the short one: later
    chunks attend to the cached pages of earlier ones through the window."""
    hf = write_checkpoint(tmp_path, "mistral_window6")
    assert_greedy_matches(tmp_path, hf, prompts_for(hf.config), max_num_batched_tokens=8)


def test_window_changes_the_result(tmp_path):
    """The window is not a no-op at these lengths: the same weights without it give other logits."""
    hf = write_checkpoint(tmp_path / "window", "mistral_window6")
    write_checkpoint(tmp_path / "full", "mistral_window6", sliding_window=None)
    prompt = prompts_for(hf.config)[1]
    windowed, full = (build(tmp_path / d) for d in ("window", "full"))
    a, b = (PagedRun(m, 1, MAX_LEN).prefill([prompt])[0] for m in (windowed, full))
    assert (a[:6] - b[:6]).abs().max() < ATOL  # the first 6 positions see every key either way
    assert (a[7:] - b[7:]).abs().amax(-1).min() > 1e-2


QUANTIZED = {  # name: (case, format, options)
    "mistral_window6_awq": ("mistral_window6", "awq", {"group_size": 32}),
    "qwen2_tied_window_gptq": ("qwen2_tied_window", "gptq", {"group_size": 32, "sym": True}),
    "qwen3_untied_bias_window_awq": ("qwen3_untied_bias_window", "awq", {"group_size": 32}),
    "qwen3_tied_gptq_act_order": ("qwen3_tied", "gptq", {"group_size": 32, "sym": False, "act_order": True}),
}


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_matches_transformers_on_dequantized_weights(tmp_path, name):
    case, fmt, options = QUANTIZED[name]
    hf = write_checkpoint(tmp_path / "dense", case)
    write_quantized(tmp_path / "dense", tmp_path / name, fmt, **options)
    hf = dequantized_transformers_model(hf, tmp_path / name)
    stored = load_file(tmp_path / name / "model.safetensors")
    with torch.no_grad():
        for key, param in hf.named_parameters():
            if key.endswith(".bias"):
                param.copy_(stored[key].float())
    prompts = prompts_for(hf.config)
    assert_batched_prefill_matches(build(tmp_path / name), hf, prompts)
    assert_greedy_matches(tmp_path / name, hf, prompts)


def test_triton_kernels_qwen3_window_match_transformers(tmp_path, monkeypatch):
    """Qwen3 with q/k norm and windowed layers through the Triton kernels (interpreter): prefill of a
    batch and 4 greedy tokens of each prompt equal transformers alone."""
    hf = write_checkpoint(tmp_path, "qwen3_untied_bias_window", hidden_size=32, intermediate_size=64, head_dim=8,
                          sliding_window=4, num_hidden_layers=2)
    prompts = prompts_for(hf.config)  # 5 and 15 tokens, window 4
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    assert_batched_prefill_matches(build(tmp_path), hf, prompts)
    assert_greedy_matches(tmp_path, hf, prompts, n=4)


def test_layer_types_rule_follows_transformers(tmp_path):
    """use_sliding_window / max_window_layers give the layers transformers' config class derives; a
    checkpoint's explicit layer_types wins over them."""
    write_checkpoint(tmp_path, "qwen2_tied_window")
    assert [layer.self_attn.window for layer in build(tmp_path).layers] == [0, 6, 6]
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert [layer.self_attn.window for layer in build(tmp_path).layers] == [6, 0, 6]
    config["use_sliding_window"] = False  # transformers then drops sliding_window: no window to use
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding_window=None"):
        build(tmp_path)


@pytest.mark.parametrize("field, value, match", [
    ("layer_types", ["full_attention", "chunked_attention", "full_attention"], "layer_types"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor"),
])
def test_unsupported_config_fields_are_refused(tmp_path, field, value, match):
    write_checkpoint(tmp_path, "qwen3_tied")
    config = json.loads((tmp_path / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        tritonq.load(tmp_path, max_num_seqs=1, max_seq_len=32)


def test_qk_norm_weights_must_be_read(tmp_path):
    """A Qwen3 checkpoint declared as Llama leaves q_norm / k_norm unread: refused, not ignored."""
    write_checkpoint(tmp_path, "qwen3_tied")
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="q_norm"):
        tritonq.load(tmp_path, max_num_seqs=1, max_seq_len=32)


# ---- dynamic rope: each sequence's own length decides its base ----

def write_dynamic_llama(folder, max_position_embeddings=16, original=None):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    if original is not None:
        rope["original_max_position_embeddings"] = original
    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         rope_parameters=rope, initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def test_dynamic_rope_per_sequence_in_a_mixed_batch(tmp_path):
    """A short prompt and one past max_position_embeddings=16 prefilled and decoded together: every
    prompt's logits and 16 greedy tokens equal its transformers run alone (transformers takes the NTK
    base from max(position_ids) + 1 of each forward)."""
    hf = write_dynamic_llama(tmp_path)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 24)]
    assert_batched_prefill_matches(build(tmp_path), hf, prompts)
    assert_greedy_matches(tmp_path, hf, prompts)


def test_dynamic_rope_scales_from_original_max_position_embeddings(tmp_path):
    """With original_max_position_embeddings=16 in the rope dict and max_position_embeddings=64 (the
    extended length), the base grows past 16 tokens: the result equals transformers on the same
    weights with max_position_embeddings=16 (its formula with the trained length), and differs from
    transformers reading the file as is (which would not scale before 64) past 16 tokens only."""
    write_dynamic_llama(tmp_path / "ours", max_position_embeddings=64, original=16)
    as_trained = write_dynamic_llama(tmp_path / "trained", max_position_embeddings=16)
    as_is = LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    prompt = torch.randint(0, 256, (30,)).tolist()
    got = PagedRun(build(tmp_path / "ours"), 1, MAX_LEN).prefill([prompt])[0]
    with torch.no_grad():
        expected, unscaled = (m(torch.tensor([prompt])).logits[0] for m in (as_trained, as_is))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # One base for the whole 30-token forward (position 0 is never rotated, the first few barely).
    assert (got[16:] - unscaled[16:]).abs().amax(-1).min() > 0.05
    short = prompt[:12]  # within the trained length nothing scales: all three agree
    with torch.no_grad():
        torch.testing.assert_close(PagedRun(build(tmp_path / "ours"), 1, MAX_LEN).prefill([short])[0],
                                   as_is(torch.tensor([short])).logits[0], atol=ATOL, rtol=0)


def step(positions: list[list[int]]) -> StepContext:
    """A StepContext with only what rope reads: sequence b computes positions[b] (its last is its length - 1)."""
    flat = [p for seq in positions for p in seq]
    cu = torch.tensor([0] + [len(s) for s in positions]).cumsum(0).to(torch.int32)
    return StepContext(input_ids=torch.zeros(len(flat), dtype=torch.int64), positions=torch.tensor(flat),
                       slot_mapping=torch.zeros(len(flat), dtype=torch.int64), cu_seqlens_q=cu,
                       context_lens=torch.tensor([s[-1] + 1 for s in positions], dtype=torch.int32),
                       block_table=torch.zeros(len(positions), 1, dtype=torch.int32), logit_rows=None,
                       is_prefill=True, max_position=max(flat), num_context_tokens=sum(s[-1] + 1 for s in positions),
                       num_context_blocks=len(positions))


def test_dynamic_rope_reads_nothing_back_from_the_device(monkeypatch):
    """The per-token tables come from device ops only (a CUDA-graph-capturable step): any host read of a
    tensor fails here. The rows equal each sequence's own table from the scalar formula."""
    from tritonq.kernels.norm_rope import rope_cos_sin
    scaling = {"rope_type": "dynamic", "factor": 3.0}
    rope = RopeTables(16, 10000.0, scaling, 8, 64, torch.device("cpu"), torch.float32)
    ctx = step([[0, 1, 2], [20, 21, 22, 23], [5]])

    def refuse(*args, **kwargs):
        raise AssertionError("host read of a device tensor")
    for method in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, refuse)
    cos, sin = rope(ctx)
    monkeypatch.undo()
    for rows, length in ((slice(0, 3), 3), (slice(3, 7), 24), (slice(7, 8), 6)):
        table_cos, table_sin = rope_cos_sin(16, 10000.0, length, scaling, 8)
        torch.testing.assert_close(cos[0, rows], table_cos[ctx.positions[rows]], atol=1e-5, rtol=0)
        torch.testing.assert_close(sin[0, rows], table_sin[ctx.positions[rows]], atol=1e-5, rtol=0)


def test_static_rope_tables_are_sized_once_and_refuse_positions_past_them():
    rope = RopeTables(16, 10000.0, {"rope_type": "linear", "factor": 2.0}, 8, 40, torch.device("cpu"), torch.float32)
    table = rope.cos
    assert tuple(table.shape) == (40, 16)
    rope(step([[39]]))
    assert rope.cos is table  # never regrown or moved (CUDA graphs gather from it)
    with pytest.raises(ValueError, match="max_seq_len=40"):
        rope(step([[40]]))


def test_tensor_parallel_two_ranks_match_one_process(tmp_path):
    """Qwen2 (q/k/v biases, windowed layers) dense and Qwen3 (q/k norm, all biases) AWQ on 2 CPU ranks:
    prefill logits and greedy tokens equal the single process (itself checked against transformers
    above); each rank holds half of the sharded weight bytes. Reuses the Llama TP harness."""
    from parallel import test_tensor_parallel as tp
    write_checkpoint(tmp_path / "qwen2", "qwen2_tied_window", sliding_window=4)
    write_checkpoint(tmp_path / "qwen3_dense", "qwen3_untied_bias_window", sliding_window=4, head_dim=16,
                     intermediate_size=128)  # o / down inputs split into whole 32-row groups
    write_quantized(tmp_path / "qwen3_dense", tmp_path / "qwen3_awq", "awq", group_size=32)
    folders = {name: str(tmp_path / name) for name in ("qwen2", "qwen3_awq")}
    single = {name: tp.run_steps(tritonq.load(folder, device="cpu", max_num_seqs=2, max_seq_len=24))
              for name, folder in folders.items()}
    ranks = tp.run_on_ranks(tp.run_steps, folders, tmp_path / "out")
    for name in folders:
        for result in ranks:
            for got, expected in zip(result[name]["logits"], single[name]["logits"], strict=True):
                torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
            assert 0.45 < result[name]["bytes"] / single[name]["bytes"] < 0.55
        assert ranks[0][name]["greedy"] == single[name]["greedy"]
