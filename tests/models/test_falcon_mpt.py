"""Falcon (every QKV layout: new_decoder_architecture GQA with one or two norms, multi-query, MHA; parallel and
sequential layers) and MPT (ALiBi, clip_qkv) against transformers' FalconForCausalLM / MptForCausalLM on tiny
random checkpoints: a short and a long prompt prefilled in one batch over interleaved pages vs each alone in
transformers, batched greedy tokens and their logprobs, and generation through a KV cache small enough to
preempt. float32 on both sides with the same weights: ATOL 1e-4 (as tests/models/test_llama_family.py)."""
import pytest
import torch
from models.test_llama_family import ATOL, MAX_LEN, assert_batched_prefill_matches, assert_greedy_matches, build
from models.test_llama import hf_greedy
from transformers import AutoConfig, FalconConfig, FalconForCausalLM

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.models.falcon import FalconForCausalLM as OurFalcon

pytestmark = pytest.mark.usefixtures("one_thread")

FALCON = {  # name: FalconConfig fields
    "falcon_new_arch_gqa_two_norms": dict(new_decoder_architecture=True, num_attention_heads=6, num_kv_heads=2),
    "falcon_new_arch_one_norm_bias": dict(new_decoder_architecture=True, num_attention_heads=4, num_kv_heads=2,
                                          num_ln_in_parallel_attn=1, bias=True, tie_word_embeddings=False),
    "falcon_multi_query_parallel": dict(multi_query=True, parallel_attn=True, num_attention_heads=4),
    "falcon_mha_sequential_bias": dict(multi_query=False, parallel_attn=False, num_attention_heads=4, bias=True),
}


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def randomize_norms_and_biases(model):
    """LayerNorm weights ~ N(1, 0.5), biases ~ N(0, 0.5): the paths they take matter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif p.dim() == 1:
                p.normal_(1.0, 0.5)
    return model


def write_falcon(folder, name: str, seed: int = 0, **overrides):
    tokenizer = byte_tokenizer()
    config = FalconConfig(**{**dict(hidden_size=48, num_hidden_layers=2, ffn_hidden_size=80, alibi=False,
                                    max_position_embeddings=MAX_LEN), **FALCON[name], **overrides},
                          vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = randomize_norms_and_biases(FalconForCausalLM(config).eval())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def prompts() -> list[list[int]]:
    return [torch.randint(0, 256, (5,)).tolist(), torch.randint(0, 256, (37,)).tolist()]


@pytest.mark.parametrize("name", list(FALCON))
def test_falcon_prefill_and_greedy_match_transformers(tmp_path, name):
    hf = write_falcon(tmp_path, name)
    batch = prompts()
    assert_batched_prefill_matches(build(tmp_path), hf, batch)
    assert_greedy_matches(tmp_path, hf, batch)


def assert_small_cache_generation_matches(folder, hf, kv_bytes_per_token: int):
    """12 prompts (1..60 tokens) through a KV cache of 8 blocks of 16 tokens with 4 running sequences and a
    32-token step budget: prompts are chunked, mixed with decodes, and preempted; each prompt's greedy tokens
    equal transformers' for that prompt alone."""
    blocks, block_size = 8, 16
    model = tritonq.load(folder, max_seq_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=32, block_size=block_size,
                         kv_cache_gb=blocks * block_size * kv_bytes_per_token / 2 ** 30)
    assert model.engine.block_manager.num_blocks == blocks
    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, 256, (int(n),), generator=generator).tolist()
             for n in torch.randint(1, 61, (12,), generator=generator)]
    eos = model.tokenizer.eos_token_id
    expected = [hf_greedy(hf, p, 6, eos)[0] for p in batch]
    got = model.generate(batch, max_new_tokens=6, return_dict=True, progress=False).token_ids
    assert got == expected
    assert model.engine.scheduler.num_preemptions > 0


def test_falcon_small_cache_preempts_and_matches_transformers(tmp_path):
    hf = write_falcon(tmp_path, "falcon_new_arch_gqa_two_norms")
    assert_small_cache_generation_matches(tmp_path, hf, 2 * 2 * 2 * 8 * 4)  # layers, k+v, kv heads, head dim, fp32


def test_falcon_refusals(tmp_path):
    write_falcon(tmp_path / "alibi", "falcon_mha_sequential_bias", alibi=True)
    with pytest.raises(ValueError, match="alibi=true .* is not supported"):
        build(tmp_path / "alibi")
    write_falcon(tmp_path / "mqa", "falcon_multi_query_parallel")
    with pytest.raises(ValueError, match="holds 1 head group.*cannot be split across tensor_parallel=2"):
        OurFalcon(AutoConfig.from_pretrained(tmp_path / "mqa"),
                          get_loader(tmp_path / "mqa", torch.float32, "cpu", rank=0, world=2), torch.float32, "cpu")
