"""Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 and GLM-4.5 on 2 ranks, Mixtral also on 4 (tensor and expert parallel)
against one process, through tritonq.load.

Ranks are CPU processes (gloo) spawned as in tests/parallel/test_tensor_parallel.py, with the tiny random checkpoints of
tests/models/test_moe_models.py (dense, AWQ and GPTQ experts written by tritonq's writer; there checked against
transformers in one process: the independent reference).
Both sides compute in float32 from the same weights; the ranks only regroup sums (o_proj, down_proj, every
expert's and the shared expert's down add 2 partial dot products, all-reduced), so logits differ by float32
rounding of O(1) values over three layers: atol 1e-4, as in test_tensor_parallel and test_moe_parallel; greedy
tokens must be equal.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models.test_moe_models import write_checkpoint
from test_tensor_parallel import _free_port

import tritonq
from tritonq.models.moe import SparseMoE
from tritonq.quantize.writer import write_quantized

ATOL = 1e-4
CHECKPOINTS = {  # name: (tests/models/test_moe_models.CASES name, config overrides, write_quantized format, options)
    **{case: (case, {}, None, {}) for case in ("qwen3_moe", "qwen3_moe_step2_window", "qwen2_moe", "mixtral_window",
                                               "deepseek_v3", "glm4_moe")},
    # AWQ group 32: o_proj K 128 and experts' I 64 split into whole groups and packs at 2 ranks (TP), whole experts (EP)
    "qwen3_moe_awq": ("qwen3_moe", {"moe_intermediate_size": 64, "intermediate_size": 128, "head_dim": 32}, "awq", {"group_size": 32}),
    # GPTQ act-order: Mixtral's I 96 would cut a 32-group at 2 ranks, so expert parallel (whole experts)
    # vocab 264 (the byte tokenizer's 258, padded): 4 ranks split it; Mixtral's 4 experts: one per rank under EP
    "mixtral_vocab264": ("mixtral_window", {"vocab_size": 264}, None, {}),
    "mixtral_gptq": ("mixtral_window", {}, "gptq", {"group_size": 32, "sym": True, "act_order": True}),
}
RUNS = {  # name: (checkpoint, expert_parallel)
    "qwen3_moe-tp": ("qwen3_moe", False),
    "qwen3_moe-ep": ("qwen3_moe", True),
    "qwen3_moe_step2_window-tp": ("qwen3_moe_step2_window", False),
    "qwen2_moe-tp": ("qwen2_moe", False),
    "qwen2_moe-ep": ("qwen2_moe", True),
    "mixtral_window-tp": ("mixtral_window", False),
    "mixtral_window-ep": ("mixtral_window", True),
    "deepseek_v3-tp": ("deepseek_v3", False),
    "deepseek_v3-ep": ("deepseek_v3", True),
    "glm4_moe-tp": ("glm4_moe", False),
    "glm4_moe-ep": ("glm4_moe", True),
    "qwen3_moe_awq-tp": ("qwen3_moe_awq", False),
    "qwen3_moe_awq-ep": ("qwen3_moe_awq", True),
    "mixtral_gptq-ep": ("mixtral_gptq", True),
}
RUNS4 = {"mixtral_vocab264-tp": ("mixtral_vocab264", False), "mixtral_vocab264-ep": ("mixtral_vocab264", True)}
PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 1, 250], [64, 65, 66, 67]]


def run_steps(model: tritonq.Model) -> dict:
    """Every prompt's prefill logits [S, V], greedy tokens (decoded through the paged cache), and the stacked
    expert shape [E, 2 * I, D] this process holds for the first MoE layer."""
    moe = next(m for m in model.model.modules() if isinstance(m, SparseMoE))
    greedy = model.generate(PROMPTS, max_new_tokens=5, return_dict=True)
    return {"logits": [model.engine.prompt_logits(p) for p in PROMPTS],
            "greedy": None if greedy is None else greedy.token_ids,
            "experts": tuple(moe.experts.gate_up.stacked_shape("gate_up"))}


def _load(folder, expert_parallel: bool, **options) -> tritonq.Model:
    return tritonq.load(folder, device="cpu", dtype=torch.float32, max_num_seqs=2, max_seq_len=32,
                        **({"expert_parallel": True} if expert_parallel else {}), **options)


def _rank_main(rank: int, world: int, port: int, folders: dict[str, str], runs: list[str], out: str) -> None:
    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRITONQ_BACKEND": "torch"}
    torch.set_num_threads(1)
    results = {name: run_steps(_load(folders[(RUNS | RUNS4)[name][0]], (RUNS | RUNS4)[name][1],
                                     tensor_parallel=world)) for name in runs}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{checkpoint name: folder}, and {run name: single-process result}."""
    root = tmp_path_factory.mktemp("tp_moe")
    folders, single = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        for checkpoint, (case, overrides, fmt, options) in CHECKPOINTS.items():
            write_checkpoint(root / f"{checkpoint}_dense", case, **overrides)
            folders[checkpoint] = str(root / f"{checkpoint}_dense" if fmt is None else
                                      write_quantized(root / f"{checkpoint}_dense", root / checkpoint, fmt, **options))
        for name, (checkpoint, _) in (RUNS | RUNS4).items():
            single[name] = run_steps(_load(folders[checkpoint], False))
    return folders, single


def spawn(checkpoints, world: int, runs: dict) -> dict:
    """{run name: (single-process result, [rank results])}: one spawn of `world` ranks for all runs."""
    folders, single = checkpoints
    out = Path(next(iter(folders.values()))).parent / f"out{world}"
    out.mkdir()
    torch.multiprocessing.spawn(_rank_main, args=(world, _free_port(), folders, list(runs), str(out)), nprocs=world,
                                join=True)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return {name: (single[name], [r[name] for r in ranks]) for name in runs}


def check(single: dict, ranks: list[dict], expert_parallel: bool) -> None:
    world = len(ranks)
    for result in ranks:
        for got, expected in zip(result["logits"], single["logits"], strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert ranks[0]["greedy"] == single["greedy"]
    assert all(result["greedy"] is None for result in ranks[1:])  # only rank 0 returns generated text
    E, two_i, D = single["experts"]
    held = (E // world, two_i, D) if expert_parallel else (E, two_i // world, D)  # whole experts, or split by I
    assert all(result["experts"] == held for result in ranks)


@pytest.fixture(scope="module")
def two_ranks(checkpoints):
    return spawn(checkpoints, 2, RUNS)


@pytest.fixture(scope="module")
def four_ranks(checkpoints):
    return spawn(checkpoints, 4, RUNS4)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_match_single_process(two_ranks, name):
    check(*two_ranks[name], RUNS[name][1])


@pytest.mark.parametrize("name", list(RUNS4))
def test_four_ranks_match_single_process(four_ranks, name):
    check(*four_ranks[name], RUNS4[name][1])
