"""`python -m tritonq.bench model`: the static bandwidth model of the decode linears (tritonq/bench/model.py).

The bounds are checked against the spec-sheet arithmetic done here by hand for one launch, the layer shapes
against the models' published configs, the command line's bad input before any compile, and one real run
(AOT compiles, in a child without TRITON_INTERPRET) for its block rows.
"""
import json

import pytest
from child_process import json_from_child

from tritonq.bench import model
from tritonq.kernels import int4_gemm
from tritonq.kernels.aot import LoopMix


def test_layer_shapes_match_the_published_configs():
    # Llama-3-8B and Qwen3-8B: 32 query / 8 kv heads of 128, MLP 14336 and 12288 (their config.json files).
    assert model.model_gemm_shapes(model.MODELS["Llama-3-8B"]) == [
        ("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096), ("down_proj", 4096, 14336)]
    assert model.model_gemm_shapes(model.MODELS["Qwen3-8B"]) == [
        ("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 24576, 4096), ("down_proj", 4096, 12288)]


def test_bounds_follow_the_spec_sheet_arithmetic():
    N = K = 4096
    launch = int4_gemm.aot_launch(int4_gemm.default_config(1, N, K), 1, N, K)  # AWQ, group 128, fp16, M = 1
    tile = launch.args["BLOCK_K"] * launch.args["BLOCK_N"]
    threads = 32 * launch.num_warps
    mix = LoopMix(cc=90, loop={"HFMA2": 7 * tile // threads}, local_memory=0, registers=64, shared_bytes=0)
    # bytes: 4-bit codes, fp16 scales and zeros per 128 rows, x in fp16, the split-K fp32 partials, the fp16
    # output the last slice writes, and one int32 arrival counter per output tile
    split_k = launch.grid[2]
    weight_bytes = (N * K // 2 + 2 * (K // 128) * N * 2 + K * 2 + split_k * N * 4 + N * 2
                    + 4 * launch.grid[0] * launch.grid[1])
    per_weight = weight_bytes / (N * K)
    gpu = model.GPUS["H200"]
    p = model.predict(mix, launch, N, K, gpu, latency_ns=600)
    weights_per_clock = 4800 / (132 * 1.98 * per_weight)  # ~36 int4 weights per SM per clock
    assert p["instr_per_weight"] == 7
    assert p["issue"] == pytest.approx(128 / (weights_per_clock * 7))
    # 64 registers x 128 threads: 8 programs fit an SM; the grid has fewer per SM
    resident = min(8, launch.grid[0] * launch.grid[1] * split_k / 132)
    in_flight = resident * tile * per_weight * (launch.num_stages - 1)
    assert p["latency"] == pytest.approx(min(1, in_flight / (4800 * 600 / 132)))
    assert p["predicted"] == min(p["issue"], p["latency"])


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "A100"], "--gpu: unknown A100"),
    (["--weights", "int3"], "--weights: unknown int3"),
    (["--m", "32"], "M in 1..16"),
    (["--latency-ns", "0"], "positive"),
])
def test_bad_arguments_fail_before_compiling(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        model.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_model_bench_predicts_block_fractions_aot():
    script = ("import json; from tritonq.bench import model; "
              "print(json.dumps(model.rows(['H200'], ['w8a8', 'int4-gptq'], 1, 600.0)))")
    rows = json_from_child(["-c", script], timeout=1200)
    blocks = [r for r in rows if r["layer"] == "block"]
    assert [(r["model"], r["weight"]) for r in blocks] == [
        (m, w) for m in model.MODELS for w in ("w8a8", "int4-gptq")]
    assert all(0 < r["predicted"] <= 1 for r in rows)
    for r in rows:
        if r["layer"] != "block":  # each linear: its loop's ALU share of a few instructions per weight
            assert 0 < r["alu_per_weight"] <= r["instr_per_weight"] < 20, json.dumps(r)
