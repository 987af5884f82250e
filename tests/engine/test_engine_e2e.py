"""The engine end to end against transformers: many prompts, a small KV cache, chunked prefill.

40 prompts of random lengths 1..300 go to one generate() call with max_num_seqs=8, a token budget
of 128 per step (so long prompts are prefilled in chunks) and a KV cache of 32 blocks of 16 tokens
(512 tokens: far fewer than the prompts need at once, so sequences wait, and decode steps run out
of blocks and preempt). Every prompt's greedy tokens must equal transformers' greedy tokens for
that prompt alone. Tiny models (hidden 64, 2 layers) in float32 through the torch references.
"""
import random

import pytest
import torch
from models.test_deepseek_v2 import COMMON, CONFIGS, dequantized_reference, quantize_linear_inputs_fp8
from models.test_llama import dequantized_transformers_model, hf_greedy, write_checkpoint
from transformers import DeepseekV2Config
from transformers import DeepseekV2ForCausalLM as HFDeepseekV2

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.config import EngineConfig
from tritonq.engine.engine import Engine
from tritonq.formats.registry import get_loader
from tritonq.api.model import Model
from tritonq.models.deepseek_v2 import DeepseekV2ForCausalLM
from tritonq.quantize.writer import write_quantized

NUM_PROMPTS, MAX_PROMPT, NEW_TOKENS = 40, 300, 6
NUM_BLOCKS, BLOCK_SIZE, MAX_NUM_SEQS, TOKEN_BUDGET = 32, 16, 8, 128
ENGINE = dict(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=TOKEN_BUDGET, block_size=BLOCK_SIZE)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, MAX_PROMPT))] for _ in range(NUM_PROMPTS)]


def kv_cache_gb(bytes_per_token: int, blocks: int = NUM_BLOCKS) -> float:
    """The budget that buys exactly `blocks` blocks."""
    return blocks * BLOCK_SIZE * bytes_per_token / 2 ** 30


def check_engine_run(model: tritonq.Model, prompts, expected: list[list[int]]) -> None:
    """generate() on all prompts at once gives each prompt's expected tokens; the run waited, chunked,
    preempted, and left every block free."""
    engine = model.engine
    assert engine.block_manager.num_blocks == NUM_BLOCKS
    out = model.generate(prompts, max_new_tokens=NEW_TOKENS, return_dict=True, progress=False)
    for i, (got, want) in enumerate(zip(out.token_ids, expected, strict=True)):
        assert got == want, f"prompt {i} ({len(prompts[i])} tokens)"
    assert engine.scheduler.num_preemptions > 0  # the cache was too small for the running batch
    assert sum(map(len, prompts)) > NUM_BLOCKS * BLOCK_SIZE
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS and not engine.has_unfinished()


# ---- Llama: dense, AWQ, GPTQ act-order, FP8 ----------------------------------------------------------

LLAMA_FORMATS = {"dense": None, "awq": ("awq", {"group_size": 32}),
                 "gptq_act_order": ("gptq", {"group_size": 32, "sym": True, "act_order": True}),
                 "fp8": ("fp8", {})}


@pytest.mark.parametrize("name", list(LLAMA_FORMATS))
def test_llama_many_prompts_small_cache_equal_transformers_greedy(tmp_path, name, monkeypatch):
    hf = write_checkpoint(tmp_path / "dense", kv_heads=2, tied=True, bias=True, rope="llama3")
    folder = tmp_path / "dense"
    if LLAMA_FORMATS[name] is not None:
        fmt, options = LLAMA_FORMATS[name]
        folder = write_quantized(tmp_path / "dense", tmp_path / name, fmt, **options)
        hf = dequantized_transformers_model(hf, folder)
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32 bytes
    model = tritonq.load(folder, max_seq_len=MAX_PROMPT + NEW_TOKENS, kv_cache_gb=kv_cache_gb(per_token),
                         **ENGINE)
    prompts = random_prompts(256)
    eos = model.tokenizer.eos_token_id
    if name == "fp8":  # transformers quantizes each linear's input per token to e4m3, as our fp8 GEMM does
        quantize_linear_inputs_fp8(hf, monkeypatch)
    expected = [hf_greedy(hf, p, NEW_TOKENS, eos)[0] for p in prompts]
    monkeypatch.undo()
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    check_engine_run(model, prompts, expected)


# ---- DeepSeek-V2: expanded and latent caches -----------------------------------------------------------

def hf_greedy_full_forward(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward of the whole sequence (no KV cache): its
    DeepSeek-V2 generate() with a cache picks the other token at a near-tie (logit gap 0.004) of one prompt."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(folder, transformers model, tokenizer) of a tiny DeepSeek-V2 (q LoRA, yarn, grouped routing)."""
    tokenizer = byte_tokenizer()
    config = DeepseekV2Config(**dict(COMMON, num_hidden_layers=2, vocab_size=len(tokenizer),
                                     max_position_embeddings=512), **CONFIGS["v2"])
    torch.manual_seed(0)
    hf = HFDeepseekV2(config).eval()
    folder = tmp_path_factory.mktemp("deepseek")
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, hf, tokenizer


def deepseek_model(folder, hf, tokenizer, mode: str, blocks: int = NUM_BLOCKS, **engine) -> Model:
    """A Model around DeepseekV2ForCausalLM in `mode` (load() builds the latent one), with no EOS."""
    net = DeepseekV2ForCausalLM(hf.config, get_loader(folder, torch.float32, "cpu"), torch.float32, "cpu",
                                attention_mode=mode)
    options = dict(ENGINE, **engine)
    return Model(net, tokenizer, Engine(net, tokenizer, EngineConfig(max_seq_len=512, **options), eos_token_ids=set(), num_blocks=blocks), 512)


@pytest.mark.parametrize("mode", ["expanded", "latent"])
def test_deepseek_many_prompts_small_cache_equal_transformers_greedy(deepseek, mode):
    folder, hf, tokenizer = deepseek
    prompts = random_prompts(256, seed=1)
    expected = [hf_greedy_full_forward(hf, p, NEW_TOKENS) for p in prompts]
    check_engine_run(deepseek_model(folder, hf, tokenizer, mode), prompts, expected)


def test_deepseek_quantized_through_load_equal_transformers_greedy(deepseek, tmp_path):
    """tritonq.load of an AWQ DeepSeek-V2 (latent cache) with the engine options, against transformers on the
    dequantized weights."""
    folder, hf, tokenizer = deepseek
    quantized = write_quantized(folder, tmp_path / "awq", "awq", group_size=32)
    (tmp_path / "ref").mkdir()
    reference = dequantized_reference(folder, quantized, tmp_path / "ref")
    per_token = 2 * (32 + 8) * 4  # layers x (latent + rope) x fp32 bytes
    model = tritonq.load(quantized, max_seq_len=MAX_PROMPT + NEW_TOKENS, kv_cache_gb=kv_cache_gb(per_token),
                         **ENGINE)
    model.eos_token_ids = set()
    prompts = random_prompts(256, seed=2)
    expected = [hf_greedy_full_forward(reference, p, NEW_TOKENS) for p in prompts]
    check_engine_run(model, prompts, expected)
