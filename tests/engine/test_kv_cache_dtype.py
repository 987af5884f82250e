"""tritonq.load(kv_cache_dtype="fp8" | "int8"): the engine over 8-bit KV pages.

Quantization changes the outputs, so the reference for each KV dtype is the same model with the same KV dtype
run another way: prompts arriving one per step into a cache too small for them (preemption, chunked prefill,
shared prefix blocks) give their solo greedy runs; the Triton kernels (interpreter) give the torch references'
tokens and log-probabilities. A KV write depends only on the token's own K/V (int8: its row's absmax; fp8: the
layer's fixed scale), never on what else is batched, which is what makes those equalities exact up to summation
order. Also: the sizing counts 1-byte values (+ int8 scales) and logs what fits, fp8 takes the checkpoint's
k_scale / v_scale, and bad values are refused before anything is read.
"""

import pytest
import safetensors.torch
import torch
from models.test_llama import write_checkpoint
from tolerances import assert_greedy_equal, solo_runs, staggered_run

import tritonq
from tritonq.api.model import GenerationConfig
from tritonq.kernels.attention import QuantizedPages

KINDS = ["fp8", "int8"]
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # write_checkpoint's tiny Llama (hidden 64, 4 heads)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, kv_heads=KV_HEADS, tied=False, bias=True, rope="llama3")
    return path


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def load(folder, **options):
    return tritonq.load(folder, max_seq_len=256, dtype=torch.float32,
                        **{"max_num_seqs": 4, "max_num_batched_tokens": 64, **options})


def bytes_per_token(kind: str) -> int:
    """Independent of KVLayout: per layer and kv head, k and v of HEAD_DIM bytes, plus int8's two fp32 scales."""
    return LAYERS * KV_HEADS * (2 * HEAD_DIM + (2 * 4 if kind == "int8" else 0))


@pytest.mark.parametrize("kind", KINDS)
def test_pages_are_8_bit_and_the_sizing_counts_them(folder, kind, caplog):
    with caplog.at_level("INFO", logger="tritonq"):
        model = load(folder, kv_cache_dtype=kind, kv_cache_gb=100 * 16 * bytes_per_token(kind) / 2 ** 30 + 1e-9)
    assert model.engine.block_manager.num_blocks == 100
    k = model.engine.runner.cache.k[0]
    assert isinstance(k, QuantizedPages) and k.data.shape == (100, 16, KV_HEADS, HEAD_DIM)
    assert k.data.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kind]
    assert k.scale.shape == ((100, 16, KV_HEADS) if kind == "int8" else ())
    fp32_per_token = LAYERS * KV_HEADS * 2 * HEAD_DIM * 4
    assert (f"KV cache dtype {kind}: {bytes_per_token(kind)} bytes per token ({fp32_per_token} in torch.float32)"
            in caplog.text)
    # the same memory in fp32 pages: 100 blocks x the byte ratio, at 16 blocks per max_seq_len sequence
    fit = 100 / 16 * bytes_per_token(kind) / fp32_per_token
    assert f"sequences of max_seq_len=256, {fit:.1f} in torch.float32" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_prompts_under_preemption_and_shared_prefixes_give_their_solo_runs(folder, kind):
    """As test_engine's test of the same name, each KV dtype against itself."""
    model = load(folder, kv_cache_dtype=kind, kv_cache_gb=8 * 16 * bytes_per_token(kind) / 2 ** 30,
                 max_num_batched_tokens=32)
    engine = model.engine
    assert engine.block_manager.num_blocks == 8
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 256, (32,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 256, (16 if i % 4 else 7,), generator=g).tolist() for i in range(8)]
    got = staggered_run(engine, prompts, GenerationConfig(max_new_tokens=12))
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    plain = load(folder, kv_cache_dtype=kind, enable_prefix_caching=False)
    assert_greedy_equal(plain, prompts, got, solo_runs(plain, prompts, max_new_tokens=12))


@pytest.mark.parametrize("kind", KINDS)
def test_triton_kernels_give_the_references_tokens_over_8_bit_pages(tmp_path, monkeypatch, kind):
    """The interpreter runs the quantizing write, a prefix hit and 16-token chunks over cached 8-bit pages and
    the paged decode; the torch references (one chunk, no prefix caching) give the same tokens and logprobs."""
    write_checkpoint(tmp_path, kv_heads=2, tied=True, bias=True, rope="llama3", hidden=32)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 256, (35,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9)]
    options = dict(max_seq_len=64, max_num_seqs=2, dtype=torch.float32, kv_cache_dtype=kind)
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    kernels = tritonq.load(tmp_path, max_num_batched_tokens=16, **options)
    first = kernels.generate(prompts[0], max_new_tokens=3, return_dict=True)
    second = kernels.generate(prompts[1], max_new_tokens=3, return_dict=True)
    assert kernels.engine.block_manager.prefix_hits == 32
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    reference = tritonq.load(tmp_path, max_num_batched_tokens=64, enable_prefix_caching=False, **options)
    want = reference.generate(prompts, max_new_tokens=3, return_dict=True)
    assert first.token_ids + second.token_ids == want.token_ids
    for got, expected in zip(first.logprobs + second.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)


def add_tensors(folder, tensors: dict) -> None:
    """Add tensors to the checkpoint's (single) safetensors file."""
    path = folder / "model.safetensors"
    stored = safetensors.torch.load_file(path)
    safetensors.torch.save_file({**stored, **tensors}, path, metadata={"format": "pt"})


def test_fp8_takes_the_checkpoints_kv_scales_else_one(tmp_path, caplog, recwarn):
    write_checkpoint(tmp_path, kv_heads=KV_HEADS, tied=False, bias=True, rope="llama3")
    with caplog.at_level("INFO", logger="tritonq"):
        plain = load(tmp_path, kv_cache_dtype="fp8")
    assert [p.scale.item() for p in plain.engine.runner.cache.k + plain.engine.runner.cache.v] == [1.0] * 4
    assert "scale 1.0 (the checkpoint has no self_attn.k_scale / v_scale" in caplog.text
    add_tensors(tmp_path, {f"model.layers.{i}.self_attn.{which}": torch.tensor(value)
                           for i in range(LAYERS) for which, value in (("k_scale", 0.5 + i), ("v_scale", 0.25))})
    caplog.clear()
    with caplog.at_level("INFO", logger="tritonq"):
        scaled = load(tmp_path, kv_cache_dtype="fp8")
    cache = scaled.engine.runner.cache
    assert [p.scale.item() for p in cache.k] == [0.5, 1.5] and [p.scale.item() for p in cache.v] == [0.25, 0.25]
    assert "fp8 e4m3 with the checkpoint's per-tensor scales (self_attn.k_scale / v_scale, 4 of 4)" in caplog.text
    assert not any("ignoring" in str(w.message) for w in recwarn)  # read, so not reported as unused
    assert load(tmp_path).engine.runner.cache.k[0].dtype == torch.float32  # auto ignores them
    add_tensors(tmp_path, {"model.layers.1.self_attn.k_scale": torch.tensor([0.5, 0.5])})
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_scale is \(2,\).*one positive finite scale"):
        load(tmp_path, kv_cache_dtype="fp8")


@pytest.mark.parametrize("bad", ["fp16", "int4", None, 8])
def test_bad_kv_cache_dtype_is_refused_before_anything_is_read(bad):
    with pytest.raises(ValueError, match=r"kv_cache_dtype=.*expected one of \('auto', 'fp8', 'int8'\)"):
        tritonq.load("/nonexistent/folder", kv_cache_dtype=bad)


@pytest.mark.parametrize("kind", KINDS)
def test_mla_latent_cache_in_8_bits_gives_each_prompt_its_solo_run(tmp_path, kind):
    """DeepSeek-V2's latent cache (one kv head of latent + rope, v a view of it, one shared scale): prompts batched
    and prefilled in 8-token chunks (the latent prefill reads the cached chunks back, dequantized) give their solo
    runs, and the pages are 8-bit with the latent's single scale tensor."""
    from transformers import DeepseekV2Config
    from transformers import DeepseekV2ForCausalLM as HFDeepseekV2

    from tritonq.demo import byte_tokenizer

    tokenizer = byte_tokenizer()
    config = DeepseekV2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                              qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, initializer_range=0.1,
                              first_k_dense_replace=1, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                              q_lora_rank=None, topk_method="greedy", bos_token_id=None, eos_token_id=None,
                              pad_token_id=0)
    torch.manual_seed(0)
    HFDeepseekV2(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = tritonq.load(tmp_path, dtype=torch.float32, max_seq_len=64, max_num_seqs=3, max_num_batched_tokens=8,
                         kv_cache_dtype=kind)
    k, v = model.engine.runner.cache.k[0], model.engine.runner.cache.v[0]
    assert isinstance(k, QuantizedPages) and k.data.shape[2:] == (1, 32 + 8) and v.scale is k.scale
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (19, 5, 12)]
    batched = model.generate(prompts, max_new_tokens=6, return_dict=True)
    assert_greedy_equal(model, prompts, batched, solo_runs(model, prompts, max_new_tokens=6))
