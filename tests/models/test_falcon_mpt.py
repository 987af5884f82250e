"""Falcon (every QKV layout: new_decoder_architecture GQA with one or two norms, multi-query, MHA; parallel and
sequential layers) and MPT (ALiBi, clip_qkv) against transformers' FalconForCausalLM / MptForCausalLM on tiny
random checkpoints: a short and a long prompt prefilled in one batch over interleaved pages vs each alone in
transformers, batched greedy tokens and their logprobs, and generation through a KV cache small enough to
preempt; then both families on 2 tensor-parallel CPU ranks against one process (and MPT's refused splits).
float32 on both sides with the same weights: ATOL 1e-4 (as tests/models/test_llama_family.py)."""
import re

import pytest
import torch
from models.paged import PagedRun
from models.test_llama_family import ATOL, MAX_LEN, assert_batched_prefill_matches, assert_greedy_matches, build
from models.test_llama import hf_greedy
from transformers import AutoConfig, FalconConfig, FalconForCausalLM, MptConfig, MptForCausalLM

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.formats.layers import Linear
from tritonq.models.falcon import FalconForCausalLM as OurFalcon
from tritonq.models.mpt import MptForCausalLM as OurMpt
from tritonq.quantize.writer import write_quantized

pytestmark = pytest.mark.usefixtures("one_thread")

FALCON = {  # name: FalconConfig fields
    "falcon_new_arch_gqa_two_norms": dict(new_decoder_architecture=True, num_attention_heads=6, num_kv_heads=2),
    "falcon_new_arch_one_norm_bias": dict(new_decoder_architecture=True, num_attention_heads=4, num_kv_heads=2,
                                          num_ln_in_parallel_attn=1, bias=True, tie_word_embeddings=False),
    "falcon_multi_query_parallel": dict(multi_query=True, parallel_attn=True, num_attention_heads=4),
    "falcon_mha_sequential_bias": dict(multi_query=False, parallel_attn=False, num_attention_heads=4, bias=True),
    "falcon_mha_parallel": dict(multi_query=False, parallel_attn=True, num_attention_heads=4),  # the older parallel form
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


# ---------------------------------------------------------------- MPT

MPT = {  # name: MptConfig fields; head counts 6 and 5 take ALiBi's rule for non-powers of two
    "mpt_6_heads": dict(n_heads=6),
    "mpt_5_heads_clip_qkv_untied": dict(n_heads=5, d_model=40, attn_config={"clip_qkv": 0.05},
                                        tie_word_embeddings=False),
    "mpt_4_heads_tied": dict(n_heads=4),
}


def write_mpt(folder, name: str, seed: int = 0, **overrides):
    tokenizer = byte_tokenizer()
    config = MptConfig(**{**dict(d_model=48, n_layers=2, expansion_ratio=4, max_seq_len=MAX_LEN), **MPT[name],
                          **overrides}, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = randomize_norms_and_biases(MptForCausalLM(config).eval())
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", list(MPT))
def test_mpt_prefill_and_greedy_match_transformers(tmp_path, name):
    hf = write_mpt(tmp_path, name)
    batch = prompts()
    assert_batched_prefill_matches(build(tmp_path), hf, batch)
    assert_greedy_matches(tmp_path, hf, batch)


def test_mpt_clip_qkv_changes_the_result(tmp_path):
    """clip_qkv clamps (the tiny model's q/k/v exceed 0.05): the same weights without it give other logits."""
    hf = write_mpt(tmp_path / "clip", "mpt_5_heads_clip_qkv_untied")
    write_mpt(tmp_path / "free", "mpt_5_heads_clip_qkv_untied", attn_config={})
    prompt = prompts()[1]
    clip, free = (PagedRun(build(tmp_path / d), 1, MAX_LEN).prefill([prompt])[0] for d in ("clip", "free"))
    assert (clip - free).abs().max() > 1e-2
    with torch.no_grad():
        torch.testing.assert_close(clip, hf(torch.tensor([prompt])).logits[0], atol=ATOL, rtol=0)


def test_mpt_small_cache_preempts_and_matches_transformers(tmp_path):
    hf = write_mpt(tmp_path, "mpt_6_heads")
    assert_small_cache_generation_matches(tmp_path, hf, 2 * 2 * 6 * 8 * 4)  # layers, k+v, heads, head dim, fp32


def test_mpt_through_the_triton_kernels_and_the_cpu_backend(tmp_path, monkeypatch):
    """The ALiBi prefill and decode kernels (Triton's interpreter) and the CPU backend's attention in a model."""
    hf = write_mpt(tmp_path, "mpt_6_heads", n_layers=1)
    batch = [prompts()[0], prompts()[1][:19]]
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    assert_batched_prefill_matches(build(tmp_path), hf, batch)
    assert_greedy_matches(tmp_path, hf, batch, n=3)
    monkeypatch.delenv("TRITONQ_BACKEND")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_greedy_matches(tmp_path, hf, batch, n=6)


@pytest.mark.parametrize("attn_config, match", [
    ({"alibi": False}, "attn_config.alibi=false"),
    ({"qk_ln": True}, "attn_config.qk_ln=True is not supported"),
    ({"attn_type": "multiquery_attention"}, "attn_type='multiquery_attention' is not supported"),
    ({"alibi_bias_max": 16}, "alibi_bias_max=16 is not supported .supported: 8.: transformers' MPT ignores"),
])
def test_mpt_refusals(tmp_path, attn_config, match):
    write_mpt(tmp_path, "mpt_6_heads", attn_config=attn_config)
    with pytest.raises(ValueError, match=match):
        build(tmp_path)



TP_PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 1, 250], [64, 65, 66, 67]]


def tp_run(model: tritonq.Model) -> dict:
    """Prefill logits of each prompt, batched greedy tokens, and the bytes of every linear and the embedding
    (all of which tensor parallelism splits)."""
    logits = [model.engine.prompt_logits(p) for p in TP_PROMPTS]
    greedy = model.generate(TP_PROMPTS, max_new_tokens=4, return_dict=True)  # None on ranks > 0
    tensors = {id(model.model.embed_tokens.weight): model.model.embed_tokens.weight}
    for module in model.model.modules():
        if isinstance(module, Linear):
            tensors |= {id(t): t for t in module.weight.tensors().values()}
    return {"logits": logits, "greedy": None if greedy is None else greedy.token_ids, "bytes": sum(t.nbytes for t in tensors.values())}


def test_falcon_tensor_parallel_two_ranks_match_one_process(tmp_path):
    """Falcon GQA (two norms), MHA (sequential, biases) and MHA in the older parallel form on 2 CPU ranks, each holding whole QKV groups:
    prefill logits and greedy tokens equal the single process (checked against transformers above), and
    each rank holds about half of the split layers' bytes (row-parallel biases stay on rank 0)."""
    write_falcon(tmp_path / "gqa", "falcon_new_arch_gqa_two_norms")
    write_falcon(tmp_path / "mha", "falcon_mha_sequential_bias")
    write_falcon(tmp_path / "mha_parallel", "falcon_mha_parallel")
    assert_two_ranks_match_one_process({name: tmp_path / name for name in ("gqa", "mha", "mha_parallel")},
                                       tmp_path / "out")


def assert_two_ranks_match_one_process(folders: dict, out) -> None:
    """Each checkpoint on 2 CPU ranks (tests/parallel/test_tensor_parallel.py's run_on_ranks) vs one process, both float32:
    prefill logits within ATOL (the ranks only regroup the row-parallel sums), rank 0's greedy tokens equal, and
    each rank holding about half of the split layers' bytes."""
    from parallel import test_tensor_parallel as tp
    single = {name: tp_run(tritonq.load(folder, device="cpu", max_num_seqs=2, max_seq_len=24))
              for name, folder in folders.items()}
    ranks = tp.run_on_ranks(tp_run, folders, out)
    for name in folders:
        for result in ranks:
            for got, expected in zip(result[name]["logits"], single[name]["logits"], strict=True):
                torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
            assert 0.45 < result[name]["bytes"] / single[name]["bytes"] < 0.55
        assert ranks[0][name]["greedy"] == single[name]["greedy"]


def test_mpt_tensor_parallel_two_ranks_match_one_process(tmp_path):
    """MPT on 2 CPU ranks: 6 heads tied, 6 heads untied with clip_qkv, and 4 heads AWQ (group 32; d_model 64, so each
    rank's q, k and v blocks of Wqkv are 32 columns, whole packs of 8, and out_proj's 32 inputs a whole group). Each
    rank holds its heads of q, k and v of the fused Wqkv and their ALiBi slopes (rank 1's heads have other slopes
    than rank 0's, so a wrong cut or wrong slopes change the logits); logits and greedy tokens equal the single
    process, itself checked against transformers above."""
    write_mpt(tmp_path / "tied", "mpt_6_heads")
    write_mpt(tmp_path / "untied_clip", "mpt_6_heads", attn_config={"clip_qkv": 0.05}, tie_word_embeddings=False)
    write_mpt(tmp_path / "awq_dense", "mpt_4_heads_tied", d_model=64)
    # the embedding stays dense (formats.base.ALWAYS_DENSE, as AutoAWQ does): split by vocabulary rows
    write_quantized(tmp_path / "awq_dense", tmp_path / "awq", "awq", group_size=32)
    assert_two_ranks_match_one_process({name: tmp_path / name for name in ("tied", "untied_clip", "awq")},
                                       tmp_path / "out")


def test_mpt_tensor_parallel_refusals(tmp_path):
    """Heads that do not divide over the ranks, and an AWQ Wqkv whose q / k / v blocks would be cut through a pack
    (d_model 40: 20 columns of each block per rank), are refused naming the layer before anything is read."""
    write_mpt(tmp_path / "five", "mpt_5_heads_clip_qkv_untied")
    with pytest.raises(ValueError, match="n_heads=5 cannot be divided across tensor_parallel=2"):
        build_on_rank_0_of_2(tmp_path / "five")
    write_mpt(tmp_path / "dense40", "mpt_4_heads_tied", d_model=40)
    write_quantized(tmp_path / "dense40", tmp_path / "awq40", "awq", group_size=-1)
    with pytest.raises(ValueError, match=re.escape(
            "transformer.blocks.0.attn.Wqkv: cannot split N (outputs)=120 (fused blocks of 40) column-parallel into "
            "2 parts of each block, of 20: each part must be a multiple of 8 (AWQ packs 8 output columns")):
        build_on_rank_0_of_2(tmp_path / "awq40")


def build_on_rank_0_of_2(folder):
    return OurMpt(AutoConfig.from_pretrained(folder), get_loader(folder, torch.float32, "cpu", rank=0, world=2),
                  torch.float32, "cpu")
