"""gpt-oss tensor parallel: 2 CPU ranks (gloo) against one process, dense and MXFP4 experts.

As tests/parallel/test_tensor_parallel.py: two processes joined through torchrun's environment variables load the
checkpoint with tensor_parallel=2 and run prompt logits and greedy generation; the reference is the
single-process model (itself checked against transformers in tests/models/test_gpt_oss.py). Each rank
holds half the heads (and their sinks) and every expert's half of the intermediate size (gate/up pairs
by output, down by input: whole 32-element MXFP4 groups); partial outputs are all-reduced, so logits
differ by float32 rounding only (atol 1e-4). A split through an MXFP4 group is refused naming the layer.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tensor_parallel import run_on_ranks
from transformers import GptOssConfig
from transformers import GptOssForCausalLM as HFGptOss

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.models.gpt_oss import GptOssForCausalLM
from tritonq.quantize.writer import write_quantized
from tritonq.quant.weights import MXFP4Weight

ATOL = 1e-4
WORLD = 2
PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 1, 250, 13, 8], [64, 65, 66, 67]]  # past the 8-token window
# I = 128: 64 per rank, two whole MXFP4 groups of the down projection's inputs.
CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=64, initializer_range=0.1, bos_token_id=None, eos_token_id=None,
              pad_token_id=0, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                                   beta_slow=1.0, truncate=False, original_max_position_embeddings=16))


def write_gpt_oss(folder: Path, **overrides) -> Path:
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    hf = HFGptOss(GptOssConfig(vocab_size=len(tokenizer), **{**CONFIG, **overrides}))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0, 0.5)
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_steps(model: tritonq.Model) -> dict:
    logits = [model.engine.prompt_logits(prompt) for prompt in PROMPTS]
    greedy = model.generate(PROMPTS, max_new_tokens=5, return_dict=True)
    return {"logits": logits, "greedy": None if greedy is None else greedy.token_ids,
            "mxfp4": isinstance(model.model.layers[0].mlp.down, MXFP4Weight),
            "inter": model.model.layers[0].mlp.down.stacked_shape("down")[2]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"dense" | "mxfp4": (single-process result, [rank 0, rank 1 results])}."""
    root = tmp_path_factory.mktemp("tp_gpt_oss")
    folders = {"dense": write_gpt_oss(root / "dense")}
    folders["mxfp4"] = write_quantized(folders["dense"], root / "mxfp4", "mxfp4")
    single = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        for name, folder in folders.items():
            single[name] = run_steps(tritonq.load(folder, device="cpu", dtype=torch.float32, max_num_seqs=2,
                                                  max_seq_len=24))
        ranks = run_on_ranks(run_steps, folders, root / "out")
    return {name: (single[name], [r[name] for r in ranks]) for name in folders}


@pytest.mark.parametrize("name", ["dense", "mxfp4"])
def test_two_ranks_match_single_process(runs, name):
    single, ranks = runs[name]
    assert single["mxfp4"] == (name == "mxfp4") and single["inter"] == CONFIG["intermediate_size"]
    for rank, result in enumerate(ranks):
        assert result["mxfp4"] == single["mxfp4"] and result["inter"] == CONFIG["intermediate_size"] // WORLD
        for got, expected in zip(result["logits"], single["logits"], strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert ranks[0]["greedy"] == single["greedy"] and ranks[1]["greedy"] is None


def test_split_through_an_mxfp4_group_is_refused(tmp_path):
    """I = 96 over 2 ranks: 48 inputs of down each, not whole 32-element groups."""
    dense = write_gpt_oss(tmp_path / "dense", intermediate_size=96)
    quantized = write_quantized(dense, tmp_path / "mxfp4", "mxfp4")
    loader = get_loader(quantized, torch.float32, "cpu", rank=0, world=2)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.down_proj: cannot split K \(inputs\)=96 "
                                         r"row-parallel into 2 parts of 48: each part must be a multiple of 32"):
        GptOssForCausalLM(GptOssConfig.from_pretrained(quantized), loader, torch.float32, "cpu")
