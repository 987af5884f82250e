"""DeepSeek-V2 across ranks: heads split, latent projections replicated, experts split by intermediate size
(tensor parallel) or whole per rank (expert parallel), against one process; refused splits. Also a
compressed-tensors Llama (int4 group 32, asymmetric, written by compressed-tensors itself) on 2 ranks.

Ranks are CPU processes (gloo) spawned with torch.multiprocessing, as tests/parallel/test_tensor_parallel.py does; the
reference is the single-process tritonq model (itself checked against transformers in
tests/models/test_deepseek_v2.py, both attention modes). Both sides compute in float32 from the same weights;
the ranks only regroup sums (o_proj, down_proj and every expert's down add `world` partial dot products,
all-reduced in rank order; expert parallel adds each token's k expert outputs in another grouping), so
logits differ by float32 rounding of O(1) values over three layers (measured: at most 2.4e-6 for logits up to
2.6, 2 and 4 ranks): atol 1e-4, as in test_tensor_parallel.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models.paged import PagedRun
from test_tensor_parallel import _free_port
from transformers import DeepseekV2Config
from transformers import DeepseekV2ForCausalLM as HFDeepseekV2

import tritonq
from tritonq.demo import byte_tokenizer
from tritonq.formats.registry import get_loader
from tritonq.models.deepseek_v2 import DeepseekV2ForCausalLM
from tritonq.quantize.writer import write_quantized

ATOL = 1e-4
VOCAB = 264  # byte tokenizer (258) padded so that 2, 3 and 4 ranks split it
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              max_position_embeddings=256, initializer_range=0.1, first_k_dense_replace=1, n_shared_experts=2,
              n_routed_experts=8, bos_token_id=256, eos_token_id=257, pad_token_id=0)
CONFIGS = {  # the two DeepSeek-V2 shapes of tests/models/test_deepseek_v2.py, with 8 experts (2 and 4 ranks hold 4 / 2)
    "lite": dict(q_lora_rank=None, num_experts_per_tok=2, topk_method="greedy"),
    "v2": dict(q_lora_rank=32, attention_bias=True, num_experts_per_tok=3, topk_method="group_limited_greedy",
               n_group=4, topk_group=2, routed_scaling_factor=2.5,
               rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                    original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
                                    mscale=1.0, mscale_all_dim=0.8)),
}
# name: (checkpoint, attention mode, expert_parallel, world sizes it runs at)
RUNS = {
    "lite-expanded-tp": ("lite", "expanded", False, (2, 4)),
    "lite-latent-ep": ("lite", "latent", True, (2, 4)),
    "v2-latent-tp": ("v2", "latent", False, (2,)),
    "v2-expanded-ep": ("v2", "expanded", True, (2,)),
    # AWQ (group 32): every split keeps whole groups and packs at 2 ranks (experts' I 64 -> 32)
    "v2-awq-latent-tp": ("v2-awq", "latent", False, (2,)),
    "v2-awq-expanded-ep": ("v2-awq", "expanded", True, (2,)),
}
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 200, 31], [12, 7, 33, 2]]
DECODE = [[30, 31, 32], [50, 51, 52]]


def run_steps(model) -> list[torch.Tensor]:
    """Every row's logits of a batch of two prompts over the paged cache, then 3 decode steps of both."""
    run = PagedRun(model, 2, 16)
    logits = run.prefill(PROMPTS)
    return logits + [run.decode([d[i] for d in DECODE]) for i in range(len(DECODE[0]))]


def build(folder, mode, expert_parallel, rank=0, world=1) -> DeepseekV2ForCausalLM:
    config = DeepseekV2Config.from_pretrained(folder)
    loader = get_loader(folder, torch.float32, "cpu", rank=rank, world=world)
    model = DeepseekV2ForCausalLM(config, loader, torch.float32, "cpu", attention_mode=mode,
                                  expert_parallel=expert_parallel)
    loader.finish()  # every stored tensor read (or, expert parallel, left to the rank that holds it)
    return model


def layout(model: DeepseekV2ForCausalLM) -> dict:
    """What this rank holds: heads, expert count and sizes, the replicated projections' tensors."""
    attn, moe = model.layers[1].self_attn, model.layers[1].mlp
    E, two_i, _ = moe.experts.gate_up.stacked_shape("gate_up")
    replicated = attn.kv_a_proj_with_mqa.weight
    return {"heads": attn.num_heads, "experts": E, "expert_inter": two_i // 2, "first_expert": moe.experts.first,
            "cache": (model.kv_layout.num_kv_heads, model.kv_layout.d_qk),
            "kv_a": {k: v.clone() for k, v in replicated.tensors().items()}}


def _rank_main(rank: int, world: int, port: int, folders: dict[str, str], runs: list[str], out: str) -> None:
    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRITONQ_BACKEND": "torch"}
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for name in runs:
        checkpoint, mode, expert_parallel, _ = RUNS[name]
        model = build(folders[checkpoint], mode, expert_parallel, rank, world)
        results[name] = {"logits": run_steps(model), "layout": layout(model)}
    if world == 2:  # tritonq.load end to end: expert_parallel through load(), generate() on rank 0 only
        model = tritonq.load(folders["lite"], device="cpu", dtype=torch.float32, max_num_seqs=2, max_seq_len=32,
                             expert_parallel=True)
        results["generate"] = model.generate(PROMPTS, max_new_tokens=6)
        if "llama-ct" in folders:
            results["llama-ct"] = compressed_tensors_logits(folders["llama-ct"])
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tp")
    folders = {}
    for name, options in CONFIGS.items():
        torch.manual_seed(0)
        hf = HFDeepseekV2(DeepseekV2Config(**COMMON, **options)).eval()
        with torch.no_grad():  # transformers initializes biases to zero, which would test nothing
            for param_name, param in hf.named_parameters():
                if param_name.endswith(".bias"):
                    param.normal_(0, 0.1)
        hf.save_pretrained(root / name)
        byte_tokenizer().save_pretrained(root / name)
        folders[name] = root / name
    folders["v2-awq"] = write_quantized(folders["v2"], root / "v2-awq", "awq", group_size=32)
    if importlib.util.find_spec("compressed_tensors") is not None:  # the test extra (Python >= 3.11)
        from formats.test_real_packers import CT_WEIGHT_ONLY, ct_checkpoint
        weights, fmt, _ = CT_WEIGHT_ONLY["pack-int4-group-asym"]
        ct_checkpoint(root / "llama-ct", weights, fmt, hidden=128, inter=256, heads=4, kv_heads=4)
        folders["llama-ct"] = root / "llama-ct"
    return folders


def compressed_tensors_logits(folder) -> list[torch.Tensor]:
    model = tritonq.load(folder, device="cpu", dtype=torch.float32, max_num_seqs=2, max_seq_len=32)
    return [model.engine.prompt_logits(prompt) for prompt in PROMPTS]


def spawn(folders, world: int) -> list[dict]:
    runs = [name for name, (*_, worlds) in RUNS.items() if world in worlds]
    out = Path(next(iter(folders.values()))).parent / f"out{world}"
    out.mkdir()
    torch.multiprocessing.spawn(_rank_main, args=(world, _free_port(), {k: str(v) for k, v in folders.items()}, runs,
                                                  str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def single(folders):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        results = {}
        for name, (checkpoint, mode, expert_parallel, _) in RUNS.items():
            model = build(folders[checkpoint], mode, False)
            results[name] = {"logits": run_steps(model), "layout": layout(model)}
        model = tritonq.load(folders["lite"], device="cpu", dtype=torch.float32, max_num_seqs=2, max_seq_len=32)
        results["generate"] = model.generate(PROMPTS, max_new_tokens=6)
        if "llama-ct" in folders:
            results["llama-ct"] = compressed_tensors_logits(folders["llama-ct"])
    return results


@pytest.fixture(scope="module")
def two_ranks(folders):
    return spawn(folders, 2)


@pytest.fixture(scope="module")
def four_ranks(folders):
    return spawn(folders, 4)


def check_ranks(ranks: list[dict], single: dict, name: str) -> None:
    _, mode, expert_parallel, _ = RUNS[name]
    world, whole = len(ranks), single[name]["layout"]
    for rank, result in enumerate(r[name] for r in ranks):
        for got, expected in zip(result["logits"], single[name]["logits"], strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        held = result["layout"]
        assert held["heads"] == whole["heads"] // world
        if expert_parallel:  # whole experts, E / world of them, rank r's from r * E / world
            assert (held["experts"], held["expert_inter"]) == (whole["experts"] // world, whole["expert_inter"])
            assert held["first_expert"] == rank * whole["experts"] // world
        else:  # every expert, split by its intermediate size
            assert (held["experts"], held["expert_inter"]) == (whole["experts"], whole["expert_inter"] // world)
        # the latent cache is whole on every rank; the expanded one holds the rank's heads
        assert held["cache"] == (whole["cache"] if mode == "latent" else (whole["cache"][0] // world,
                                                                          whole["cache"][1]))
        # kv_a_proj_with_mqa (quantized in the AWQ runs) is the same replicated weight on every rank
        assert held["kv_a"].keys() == whole["kv_a"].keys()
        for field, tensor in whole["kv_a"].items():
            assert torch.equal(held["kv_a"][field], tensor), field


@pytest.mark.parametrize("name", [n for n, run in RUNS.items() if 2 in run[3]])
def test_two_ranks_match_one_process(two_ranks, single, name):
    check_ranks(two_ranks, single, name)


@pytest.mark.parametrize("name", [n for n, run in RUNS.items() if 4 in run[3]])
def test_four_ranks_match_one_process(four_ranks, single, name):
    check_ranks(four_ranks, single, name)


def test_expert_parallel_load_generates_on_rank_0_only(two_ranks, single):
    assert two_ranks[0]["generate"] == single["generate"] and single["generate"]
    assert two_ranks[1]["generate"] is None


def test_compressed_tensors_on_two_ranks_match_one_process(folders, two_ranks, single):
    if "llama-ct" not in folders:
        pytest.skip("compressed-tensors is not installed (the test extra)")
    for result in two_ranks:
        for got, expected in zip(result["llama-ct"], single["llama-ct"], strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


BAD = {  # (checkpoint, world, expert_parallel, error message)
    "heads": ("lite", 3, False, r"model\.layers\.0\.self_attn: num_attention_heads=4 cannot be divided across "
                                r"tensor_parallel=3"),
    "experts": ("six-experts", 4, True,
                r"model\.layers\.1\.mlp: cannot place n_routed_experts=6 experts on tensor_parallel=4 ranks"),
    # o_proj's K = 4 heads x 16 over 4 ranks: 16 input rows per rank cut AWQ's groups of 32
    "awq_group": ("v2-awq", 4, False, r"model\.layers\.0\.self_attn\.o_proj: cannot split K \(inputs\)=64 "
                                      r"row-parallel into 4 parts of 16: each part must be a multiple of 32"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_split_that_does_not_fit_is_refused_naming_the_layer(folders, tmp_path, case):
    checkpoint, world, expert_parallel, message = BAD[case]
    if checkpoint == "six-experts":
        HFDeepseekV2(DeepseekV2Config(**dict(COMMON, num_hidden_layers=2, n_routed_experts=6),
                                      **CONFIGS["lite"])).save_pretrained(tmp_path)
        folder = tmp_path
    else:
        folder = folders[checkpoint]
    config = DeepseekV2Config.from_pretrained(folder)
    loader = get_loader(folder, torch.float32, "cpu", rank=0, world=world)
    with pytest.raises(ValueError, match=message):
        DeepseekV2ForCausalLM(config, loader, torch.float32, "cpu", expert_parallel=expert_parallel)


def test_expert_parallel_needs_a_moe_model(tmp_path):
    from models.test_llama import write_checkpoint
    write_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"expert_parallel=True needs a mixture-of-experts model; model_type 'llama'"):
        tritonq.load(tmp_path, device="cpu", expert_parallel=True)
