"""Qwen3.5, Qwen3.5-MoE (dense and AWQ) and Qwen3-Next on 2 ranks against one process, through tritonq.load, and
the refusal of head counts that do not divide by the world size.

Ranks are CPU processes (gloo) spawned as in tests/parallel/test_tensor_parallel_moe.py, with the tiny random
checkpoints of tests/models/test_qwen3_5.py (there checked against transformers in one process: the independent
reference). Each rank holds half the key and value heads of every linear-attention layer (its slice of q, k and v
of the fused in projection, of the conv channels and of the state) and half the attention heads. Both sides compute
in float32 from the same weights; the ranks only regroup sums (out_proj, o_proj and down_proj add 2 partial dot
products, all-reduced), so logits differ by float32 rounding of O(1) values: atol 1e-4; greedy tokens must be equal.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models.test_qwen3_5 import write_checkpoint
from test_tensor_parallel import _free_port
from transformers import AutoConfig

import tritonq
from tritonq.formats.registry import get_loader
from tritonq.models.qwen3_5 import GatedDeltaNet, Qwen3_5ForCausalLM
from tritonq.quantize.writer import write_quantized

ATOL = 1e-4
# q, k 32 and v 128 rows; in_proj_b / a 16 rows: whole AWQ packs of 8 on each of 2 ranks
SIZES = dict(linear_num_key_heads=4, linear_num_value_heads=16, linear_key_head_dim=8)
CHECKPOINTS = {  # name: (tests/models/test_qwen3_5.CASES name, config overrides, write_quantized format, options)
    "qwen3_5_text": ("qwen3_5_text", {}, None, {}),
    "qwen3_5_text_tied": ("qwen3_5_text_tied", {}, None, {}),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {}, None, {}),
    "qwen3_next": ("qwen3_next", {}, None, {}),
    # AWQ group 32: q, k, v, b, a cut into whole packs, out_proj's K 128 and the experts' I 64 into whole groups
    "qwen3_5_moe_awq": ("qwen3_5_moe_text", dict(SIZES, moe_intermediate_size=64, shared_expert_intermediate_size=64),
                        "awq", {"group_size": 32}),
}
PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 1, 250, 31, 8, 77, 140, 2, 19, 64, 90], [64, 65, 66, 67]]


def run_steps(model: tritonq.Model) -> dict:
    """Every prompt's prefill logits [S, V], greedy tokens, and this process's linear-attention heads (Hk, Hv)."""
    greedy = model.generate(PROMPTS, max_new_tokens=5, return_dict=True)
    mixer = next(m for m in model.model.modules() if isinstance(m, GatedDeltaNet))
    return {"logits": [model.engine.prompt_logits(p) for p in PROMPTS],
            "greedy": None if greedy is None else greedy.token_ids, "heads": (mixer.Hk, mixer.Hv)}


def _load(folder, **options) -> tritonq.Model:
    return tritonq.load(folder, device="cpu", dtype=torch.float32, max_num_seqs=2, max_seq_len=32, **options)


def _rank_main(rank: int, world: int, port: int, folders: dict[str, str], out: str) -> None:
    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRITONQ_BACKEND": "torch"}
    torch.set_num_threads(1)
    results = {name: run_steps(_load(folder, tensor_parallel=world)) for name, folder in folders.items()}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """{checkpoint name: (single-process result, [rank results])}."""
    root = tmp_path_factory.mktemp("tp_qwen3_5")
    folders, single = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        for name, (case, overrides, fmt, options) in CHECKPOINTS.items():
            write_checkpoint(root / f"{name}_dense", case, **overrides)
            folders[name] = str(root / f"{name}_dense" if fmt is None else
                                write_quantized(root / f"{name}_dense", root / name, fmt, **options))
            single[name] = run_steps(_load(folders[name]))
    out = root / "out"
    out.mkdir()
    torch.multiprocessing.spawn(_rank_main, args=(2, _free_port(), folders, str(out)), nprocs=2, join=True)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {name: (single[name], [r[name] for r in ranks]) for name in CHECKPOINTS}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_two_ranks_match_single_process(two_ranks, name):
    single, ranks = two_ranks[name]
    for result in ranks:
        for got, expected in zip(result["logits"], single["logits"], strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        Hk, Hv = single["heads"]
        assert result["heads"] == (Hk // 2, Hv // 2)
    assert ranks[0]["greedy"] == single["greedy"]
    assert all(result["greedy"] is None for result in ranks[1:])  # only rank 0 returns generated text


@pytest.mark.parametrize("overrides, named", [
    (dict(linear_num_key_heads=1, linear_num_value_heads=2), "linear_num_key_heads=1"),
    (dict(linear_num_value_heads=3, linear_num_key_heads=3), "linear_num_value_heads=3"),
    (dict(num_attention_heads=3, num_key_value_heads=1), "num_attention_heads=3"),
])
def test_heads_that_do_not_divide_by_the_world_size_are_refused(tmp_path, overrides, named):
    write_checkpoint(tmp_path, "qwen3_5_text", **overrides)
    config = AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"{named}.*tensor_parallel=2 must divide each"):
        Qwen3_5ForCausalLM(config, get_loader(tmp_path, torch.float32, "cpu", rank=0, world=2), torch.float32, "cpu")
