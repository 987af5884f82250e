"""Tensor parallelism: per-rank loader shards, refused splits, and 2 CPU ranks (gloo) against one process.

Shards: each format's rank-0 and rank-1 slices of a one-layer checkpoint, dequantized by the
formulas in docs/formats.md (written here), concatenate back to the unsharded layer exactly.
Ranks: two processes spawned with torch.multiprocessing, joined through torchrun's environment
variables, run a prefill and decode steps; the reference is the single-process tritonq model
(itself checked against transformers in tests/models/test_llama.py). Both sides compute in float32
from the same weights; tensor parallelism only regroups the sums (row-parallel layers add two
partial dot products of K/2 terms), so logits differ by float32 rounding over a few layers:
atol 1e-4 as in test_llama (logits are O(1)).
"""
from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Callable
from dataclasses import fields
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from formats.helpers import dequantize as dequantize_int4
from models.test_llama import write_checkpoint
from safetensors.torch import save_file

import tritonq
from tritonq.formats.checkpoint import Weights
from tritonq.formats.registry import get_loader
from tritonq.models.llama import LlamaForCausalLM
from tritonq.quantize.writer import quantization_config, quantized_tensors, write_quantized
from tritonq.quant.weights import DenseWeight, FP8Weight, Int4Weight

ATOL = 1e-4
WORLD = 2
PREFIX = "layer"


# ---- loader shards of one linear ---------------------------------------------------------------

def write_linear(folder: Path, fmt: str | None, N: int, K: int, bias: bool = True, **options) -> Path:
    """A checkpoint holding one linear `layer` [N, K] (random, with a bias) in format fmt (None: dense)."""
    torch.manual_seed(0)
    w, b = torch.randn(N, K), (torch.randn(N) if bias else None)
    folder.mkdir(parents=True, exist_ok=True)
    config = {}
    if fmt is None:
        tensors = {f"{PREFIX}.weight": w} | ({} if b is None else {f"{PREFIX}.bias": b})
    else:
        config["quantization_config"] = quantization_config(fmt, **options)
        tensors = quantized_tensors(PREFIX, w, config["quantization_config"], b)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def dequantize(w) -> torch.Tensor:
    """Float32 W [N, K] of a typed weight, from the docs/formats.md formulas."""
    if isinstance(w, DenseWeight):
        return w.weight.float()
    if isinstance(w, Int4Weight):
        return dequantize_int4(w)
    assert isinstance(w, FP8Weight)
    scale = w.weight_scale
    if w.block_size is not None:
        N, K = w.weight.shape
        scale = scale.repeat_interleave(w.block_size[0], 0)[:N].repeat_interleave(w.block_size[1], 1)[:, :K]
    return w.weight.float() * scale


LINEARS = {  # name: (format, N, K, writer options, loader options)
    "dense": (None, 64, 96, {}, {}),
    "dense_int4_on_load": (None, 64, 128, {}, {"quantize": "int4", "group_size": 32}),
    "awq": ("awq", 64, 128, {"group_size": 32}, {}),
    "awq_per_channel": ("awq", 64, 128, {"group_size": -1}, {}),
    "gptq_sym": ("gptq", 64, 128, {"group_size": 32, "sym": True}, {}),
    "gptq_asym_8bit": ("gptq", 64, 128, {"group_size": 32, "sym": False, "bits": 8}, {}),
    "gptq_per_channel": ("gptq", 64, 128, {"group_size": -1, "sym": False}, {}),
    "gptq_act_order": ("gptq", 64, 128, {"group_size": 32, "sym": False, "act_order": True}, {}),
    # act-order keeps every group's scales on every row shard (a shard of 48 rows, 1.5 groups: BAD_SPLITS)
    "gptq_act_order_sym": ("gptq", 64, 128, {"group_size": 32, "sym": True, "act_order": True}, {}),
    "fp8_tensor": ("fp8", 64, 96, {}, {}),
    "fp8_channel": ("fp8", 64, 96, {"fp8_scheme": "channel"}, {}),
    "fp8_block": ("fp8", 256, 256, {"fp8_scheme": "block"}, {}),
}


@pytest.fixture
def read_whole(monkeypatch):
    """Names of the tensors read whole (Weights.get_tensor) while the test runs."""
    names = []
    original = Weights.get_tensor
    monkeypatch.setattr(Weights, "get_tensor", lambda self, name, *a, **k: names.append(name) or original(
        self, name, *a, **k))
    return names


@pytest.mark.parametrize("parallel", ["column", "row"])
@pytest.mark.parametrize("name", list(LINEARS))
def test_rank_shards_concatenate_to_the_whole_layer(tmp_path, name, parallel, read_whole):
    fmt, N, K, options, loading = LINEARS[name]
    folder = write_linear(tmp_path, fmt, N, K, **options)
    whole = get_loader(folder, torch.float32, "cpu", **loading).get_linear(PREFIX, bias=True)
    read_whole.clear()
    shards = [get_loader(folder, torch.float32, "cpu", **loading, rank=r, world=WORLD).get_linear(
        PREFIX, bias=True, parallel=parallel) for r in range(WORLD)]
    # The big tensors are read slice by slice from disk, never whole (scales may be replicated).
    assert not [n for n in read_whole if n.endswith((".weight", ".qweight"))]
    dim = 0 if parallel == "column" else 1
    torch.testing.assert_close(torch.cat([dequantize(s) for s in shards], dim=dim), dequantize(whole), atol=0, rtol=0)
    for s in shards:
        assert s.shape == ((N // WORLD, K) if parallel == "column" else (N, K // WORLD))
    if parallel == "column":
        assert torch.equal(torch.cat([s.bias for s in shards]), whole.bias)
    else:  # the all-reduce adds rank 0's bias once
        assert torch.equal(shards[0].bias, whole.bias) and shards[1].bias is None
    if name.startswith("gptq_act_order") and parallel == "row":  # every group stays: rows of any group per rank
        assert all(torch.equal(s.scales, whole.scales) for s in shards)
        assert torch.equal(torch.cat([s.g_idx for s in shards]), whole.g_idx)


@pytest.mark.parametrize("segments, blocks", [(3, [32, 32, 32]), ((1, 1, 4), [16, 16, 64])])
@pytest.mark.parametrize("name", ["dense", "dense_int4_on_load", "awq", "gptq_sym", "gptq_asym_8bit", "fp8_channel"])
def test_fused_blocks_are_split_block_by_block(tmp_path, name, read_whole, segments, blocks):
    """segments=3 (MPT's Wqkv: all q rows, then all k, then all v) or blocks in proportions 1:1:4 (Qwen3.5's
    in_proj_qkv: q and k of the key heads, v of four times as many value rows): each rank holds its slice of every
    block, in block order, read slice by slice from disk; the ranks' slices of each block concatenate back to that
    block of the whole layer, bias included. N = 96: each rank's slice of a block is whole packs of 8."""
    fmt, _, K, options, loading = LINEARS[name]
    folder = write_linear(tmp_path, fmt, 96, K, **options)
    whole = get_loader(folder, torch.float32, "cpu", **loading).get_linear(PREFIX, bias=True)
    read_whole.clear()
    shards = [get_loader(folder, torch.float32, "cpu", **loading, rank=r, world=WORLD).get_linear(
        PREFIX, bias=True, parallel="column", segments=segments) for r in range(WORLD)]
    assert not [n for n in read_whole if n.endswith((".weight", ".qweight"))]
    parts = [b // WORLD for b in blocks]
    pieces = [dequantize(s).split(parts) for s in shards]  # [rank][block]
    rebuilt = torch.cat([pieces[r][b] for b in range(3) for r in range(WORLD)])
    torch.testing.assert_close(rebuilt, dequantize(whole), atol=0, rtol=0)
    biases = [s.bias.split(parts) for s in shards]
    assert torch.equal(torch.cat([biases[r][b] for b in range(3) for r in range(WORLD)]), whole.bias)


def test_kv_heads_fewer_than_ranks_are_replicated(tmp_path):
    """parts=2 KV heads over 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1."""
    folder = write_linear(tmp_path, "awq", 32, 64, group_size=32)
    whole = dequantize(get_loader(folder, torch.float32, "cpu").get_linear(PREFIX))
    for rank in range(4):
        loader = get_loader(folder, torch.float32, "cpu", rank=rank, world=4)
        part = dequantize(loader.get_linear(PREFIX, parallel="column", parts=2))
        head = rank * 2 // 4
        torch.testing.assert_close(part, whole[head * 16:(head + 1) * 16], atol=0, rtol=0)


BAD_SPLITS = {  # name: (format, N, K, options, parallel, how the error goes on after "layer: cannot split ")
    "awq_column_cuts_a_pack": ("awq", 24, 64, {"group_size": 32}, "column",
                               ("N (outputs)=24 column-parallel into 2 parts of 12: each part must be a multiple of 8 "
                               "(AWQ packs 8 output columns")),
    "awq_row_cuts_a_group": ("awq", 64, 96, {"group_size": 32}, "row",
                             ("K (inputs)=96 row-parallel into 2 parts of 48: each part must be a multiple of 32 "
                             "(a quantization group of 32 input rows")),
    "gptq_row_cuts_a_group": ("gptq", 64, 96, {"group_size": 32, "sym": True}, "row",
                              ("K (inputs)=96 row-parallel into 2 parts of 48: each part must be a multiple of 32 "
                              "(a quantization group")),
    # the int4 kernels need whole groups of rows on each rank, act-order or not
    "gptq_act_order_row_cuts_a_group": ("gptq", 64, 96, {"group_size": 32, "sym": True, "act_order": True}, "row",
                                        ("K (inputs)=96 row-parallel into 2 parts of 48: each part must be a "
                                         "multiple of 32 (a quantization group of 32 input rows, act-order included")),
    "gptq_row_cuts_a_pack": ("gptq", 64, 24, {"group_size": -1, "sym": True}, "row",
                             ("K (inputs)=24 row-parallel into 2 parts of 12: each part must be a multiple of 8 "
                             "(GPTQ qweight packs 8 input rows")),
    "gptq_column_cuts_a_pack": ("gptq", 24, 64, {"group_size": 32, "sym": False}, "column",
                                "N (outputs)=24 column-parallel into 2 parts of 12: each part must be a multiple of 8"),
    "fp8_block_column_cuts_a_block": ("fp8", 128, 256, {"fp8_scheme": "block"}, "column",
                                      ("N (outputs)=128 column-parallel into 2 parts of 64: each part must be a "
                                      "multiple of 128 (a 128x128 weight_scale_inv block")),
    "dense_row_odd": (None, 64, 33, {}, "row", "K (inputs)=33 row-parallel into 2 parts of 16.5"),
}


@pytest.mark.parametrize("name", list(BAD_SPLITS))
def test_split_through_a_pack_or_group_names_layer_and_sizes(tmp_path, name):
    fmt, N, K, options, parallel, message = BAD_SPLITS[name]
    folder = write_linear(tmp_path, fmt, N, K, bias=False, **options)
    loader = get_loader(folder, torch.float32, "cpu", rank=0, world=WORLD)
    with pytest.raises(ValueError, match="^" + re.escape(f"{PREFIX}: cannot split {message}")):
        loader.get_linear(PREFIX, parallel=parallel)


@pytest.mark.parametrize("kv_heads, world, message", [  # 4 query heads, vocabulary 258
    (2, 3, r"num_attention_heads=4 and num_key_value_heads=2 cannot be divided across tensor_parallel=3"),
    (4, 3, r"num_attention_heads=4 and num_key_value_heads=4 cannot be divided across tensor_parallel=3"),
    (2, 4, r"vocab_size=258 is not divisible by tensor_parallel=4"),
])
def test_model_refuses_heads_or_vocab_that_do_not_divide(tmp_path, kv_heads, world, message):
    from transformers import AutoConfig
    write_checkpoint(tmp_path, kv_heads=kv_heads)
    config = AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM(config, get_loader(tmp_path, torch.float32, "cpu", rank=0, world=world), torch.float32, "cpu")


def test_tensor_parallel_without_a_launcher_says_to_use_torchrun(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    write_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"tensor_parallel=2 needs 2 processes .*torchrun --nproc-per-node 2"):
        tritonq.load(tmp_path, tensor_parallel=2, device="cpu")


# ---- two ranks against one process --------------------------------------------------------------

MODELS = {  # name: (write_checkpoint options, quantized format and options or None)
    "dense_gqa_tied_bias": ({"kv_heads": 2, "tied": True, "bias": True}, None),
    "dense_one_kv_head_untied": ({"kv_heads": 1, "tied": False, "bias": False, "rope": "linear"}, None),
    "awq": ({"kv_heads": 2, "tied": True, "bias": True}, ("awq", {"group_size": 32})),
    "gptq_sym": ({"kv_heads": 2, "tied": False, "bias": False}, ("gptq", {"group_size": 32, "sym": True})),
    "gptq_act_order_asym": ({"kv_heads": 2, "tied": True, "bias": True},
                            ("gptq", {"group_size": 32, "sym": False, "act_order": True})),
}
PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 1, 250], [64, 65, 66, 67]]  # a batch of unequal lengths
DECODE_STEPS = 3


def run_steps(model: tritonq.Model) -> dict:
    """Prefill logits [S + DECODE_STEPS, V] of each prompt followed by fixed next tokens, greedy
    generate() output (tokens and logprobs, decoded through the paged cache), a seeded sample, a
    stream, and the bytes of the sharded layers. Run alike by the ranks and one process."""
    logits = []
    for b, prompt in enumerate(PROMPTS):
        fixed = [(31 * step + 11 * b) % 256 for step in range(DECODE_STEPS)]
        logits.append(model.engine.prompt_logits(prompt + fixed))
    greedy = model.generate(PROMPTS, max_new_tokens=4, return_dict=True)
    sampled = model.generate(PROMPTS[0], max_new_tokens=4, temperature=1.0, seed=0)
    streamed = list(model.stream(PROMPTS[1], max_new_tokens=3))
    return {"logits": logits, "bytes": sharded_bytes(model.model), "sampled": sampled, "streamed": streamed,
            "greedy": None if greedy is None else greedy.token_ids,
            "greedy_logprobs": None if greedy is None else greedy.logprobs}


def _tensors(w) -> list[tuple[str, torch.Tensor]]:
    return [(f.name, getattr(w, f.name)) for f in fields(w) if isinstance(getattr(w, f.name), torch.Tensor)]


def sharded_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of every tensor of the layers tensor parallelism splits (embedding, q/k/v/o, gate/up/down,
    lm_head; a tied lm_head shares the embedding's tensor and counts once)."""
    tensors = {id(model.embed_tokens.weight): model.embed_tokens.weight}
    linears = [model.lm_head] + [m for layer in model.layers for m in
                                 (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                  layer.mlp.down_proj)]
    for linear in linears:
        tensors |= {id(t): t for _, t in _tensors(linear.weight)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def expected_rank_bytes(single: LlamaForCausalLM, rank: int) -> Fraction:
    """What rank `rank` of WORLD should hold, from the single-process layers' tensors and the issue's
    rules: column layers split every N-sized tensor (q by heads, k/v by KV heads, replicated when
    there are fewer KV heads than ranks; act-order g_idx stays whole); row layers split the weight
    and g_idx along K, scales/zeros by group unless act-order or per-channel keeps them whole, and
    only rank 0 keeps the bias."""
    config = single.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    kv_share = Fraction(1, WORLD) if kv_heads >= WORLD else Fraction(1, kv_heads)
    qkv_share = (Fraction(heads, WORLD) + 2 * kv_heads * kv_share) / (heads + 2 * kv_heads)

    def column(w, share):
        return sum(t.nbytes * (1 if field == "g_idx" else share) for field, t in _tensors(w))

    def row(w):
        whole_groups = isinstance(w, Int4Weight) and (w.g_idx is not None or w.scales.shape[0] == 1)
        share = {"bias": int(rank == 0)} | ({"scales": 1, "zeros": 1} if whole_groups else {})
        return sum(t.nbytes * share.get(field, Fraction(1, WORLD)) for field, t in _tensors(w))

    total = Fraction(single.embed_tokens.weight.nbytes, WORLD)
    if single.lm_head.weight.weight is not single.embed_tokens.weight:
        total += column(single.lm_head.weight, Fraction(1, WORLD))
    for layer in single.layers:
        total += column(layer.self_attn.qkv_proj.weight, qkv_share) + column(layer.mlp.gate_up_proj.weight,
                                                                             Fraction(1, WORLD))
        total += row(layer.self_attn.o_proj.weight) + row(layer.mlp.down_proj.weight)
    return total


def _rank_main(rank: int, world: int, port: int, run: Callable[[tritonq.Model], dict], folders: dict[str, str],
               out: str) -> None:
    """One rank, joined the way torchrun starts it (environment variables; load() creates the group)."""
    os.environ |= {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TRITONQ_BACKEND": "torch"}
    torch.set_num_threads(1)
    results = {name: run(tritonq.load(folder, device="cpu", dtype=torch.float32, max_num_seqs=2, max_seq_len=24,
                                      tensor_parallel=world))
               for name, folder in folders.items()}
    assert dist.get_backend() == "gloo"
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(run: Callable[[tritonq.Model], dict], folders: dict[str, str | Path], out: Path,
                 world: int = WORLD) -> list[dict]:
    """Each checkpoint of `folders` loaded with tritonq.load(tensor_parallel=world) in `world` CPU processes (gloo;
    float32, max_num_seqs 2, max_seq_len 24) and `run(model)` called on every rank: [rank r's {name: result}].
    run must be a module-level function (the spawned ranks import it); out: a new folder for the results."""
    out.mkdir()
    torch.multiprocessing.spawn(_rank_main, args=(world, _free_port(), run, {k: str(v) for k, v in folders.items()},
                                                  str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{model name: (single-process result, [rank 0 result, rank 1 result])}: one spawn for all models."""
    root = tmp_path_factory.mktemp("tp")
    folders, single = {}, {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        for name, (options, quantized) in MODELS.items():
            folders[name] = root / name
            if quantized is None:
                write_checkpoint(folders[name], **options)
            else:
                write_checkpoint(root / f"{name}_dense", **options)
                write_quantized(root / f"{name}_dense", folders[name], quantized[0], **quantized[1])
            model = tritonq.load(folders[name], device="cpu", max_num_seqs=2, max_seq_len=24)
            single[name] = run_steps(model) | {"expected": [expected_rank_bytes(model.model, r) for r in range(WORLD)]}
        ranks = run_on_ranks(run_steps, folders, root / "out")
    return {name: (single[name], [r[name] for r in ranks]) for name in MODELS}


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_match_single_process_logits(runs, name):
    single, ranks = runs[name]
    for result in ranks:
        for got, expected in zip(result["logits"], single["logits"], strict=True):
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_holds_its_share_of_the_weight_bytes(runs, name):
    single, ranks = runs[name]
    for rank, result in enumerate(ranks):
        assert result["bytes"] == single["expected"][rank]
        share = result["bytes"] / single["bytes"]
        if MODELS[name][0]["kv_heads"] >= WORLD:  # about half: only g_idx, act-order scales, row biases differ
            assert 0.45 < share < 0.55
        else:  # the one KV head is on both ranks
            assert 0.5 < share < 0.6


@pytest.mark.parametrize("name", list(MODELS))
def test_only_rank_0_returns_generated_text(runs, name):
    single, (rank0, rank1) = runs[name]
    assert rank0["greedy"] == single["greedy"] and rank0["sampled"] == single["sampled"]
    for got, expected in zip(rank0["greedy_logprobs"], single["greedy_logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=ATOL, rtol=0)
    assert rank0["streamed"] == single["streamed"] and rank0["streamed"]
    assert rank1["greedy"] is None and rank1["sampled"] is None and rank1["streamed"] == []
