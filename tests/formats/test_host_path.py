"""The quantized linears' host path (issue 50): a Linear checks its weight once, at construction, resolves
kernel, config and launch arguments once per M bucket, and at decode M runs one launch (the split-K sum and
the cast inside it). Counted on meta weights with the launch stubbed (`tritonq.bench host`), never timed."""
import json
from dataclasses import replace

import pytest
import torch

from tritonq.bench import host
from tritonq.kernels import common
from tritonq.kernels import int4_gemm as int4
from tritonq.formats.layers import Linear

N = K = 4096  # the defaults split K at decode here (4 to 8 slices), so the one launch holds the reduction
WEIGHTS = host.weights(N, K)
# the activation-quantizing GEMMs quantize x inside the GEMM up to 16 rows; above, a quantization kernel runs first
QUANTIZED_ACTIVATIONS = {"FP8 per-tensor", "FP8 per-channel", "FP8 block 128x128", "W8A8 (per-token)"}


@pytest.mark.parametrize("name", list(WEIGHTS))
@pytest.mark.parametrize("M", [1, 3, 16, 256])
def test_one_launch_per_linear(name, M):
    layer = Linear(WEIGHTS[name])
    x = torch.empty(M, K, dtype=torch.float16, device="meta")
    _, launches = host.measure(layer, x, calls=1, rounds=1)
    assert launches == 1 + (name in QUANTIZED_ACTIVATIONS and M > 16)
    if M <= 16:  # decode: K split across programs, summed inside the GEMM's own launch
        (plan,) = layer.prepared.gemm.plans.values()
        assert plan.split_k > 1


def test_a_call_does_not_look_up_or_check_again(monkeypatch):
    """Config lookup and weight checks run once per (weight, M bucket) / weight, not per call."""
    lookups, checks = [], []
    lookup, check = common.lookup, int4._check_weight
    monkeypatch.setattr(common, "lookup", lambda *a: lookups.append(a) or lookup(*a))
    monkeypatch.setattr(int4, "_check_weight", lambda w: checks.append(1) or check(w))
    layer = Linear(WEIGHTS["int4 AWQ (asym, g128)"])
    with host._StubbedLaunches() as launches:
        for M in (1, 1, 2, 1, 2, 16, 256, 200):
            layer(torch.empty(M, K, dtype=torch.float16, device="meta"))
    assert launches.count == 8 and checks == [1]
    assert [bucket for _, bucket in lookups] == [f"M{m}_N{N}_K{K}_G128_B4" for m in (1, 2, 16, 256)]


def test_a_bad_weight_fails_when_the_linear_is_built():
    w = WEIGHTS["int4 AWQ (asym, g128)"]
    with pytest.raises(ValueError, match=r"int4_gemm: group_size is 48, expected a positive divisor of K=4096"):
        Linear(replace(w, group_size=48))


def test_host_bench_cli_prints_every_weight_type(capsys, tmp_path):
    out = tmp_path / "host.json"
    host.main(["--n", "256", "--k", "256", "--calls", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert all(name in printed for name in WEIGHTS)
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(WEIGHTS) * len(host.MS) and all(r["host_us"] > 0 for r in rows)


@pytest.mark.parametrize("kind, gemm_launches", [("int4", 2), ("mxfp4", 2), ("fp8", 4)])
def test_moe_layer_resolves_its_launches_once_per_bucket(monkeypatch, kind, gemm_launches):
    """A MoE layer (Qwen3-30B-A3B's routing: 128 experts, k 8) checks its experts once, looks configs up once
    per T bucket, and at T = 1 launches the token alignment (one program at decode sizes) and its two expert GEMMs
    (W8A8 fp8 experts: plus each GEMM's activation quantization), with no host read."""
    from tritonq.kernels import moe
    from tritonq.kernels.moe import launch as moe_launch
    E, D, inter, k = 128, 2048, 768, 8
    lookups, checks = [], []
    lookup, check = common.lookup, moe_launch.check_experts
    monkeypatch.setattr(common, "lookup", lambda *a: lookups.append(a) or lookup(*a))
    monkeypatch.setattr(moe_launch, "check_experts", lambda *a: checks.append(1) or check(*a))
    layer = moe.MoEExperts(moe.meta_experts(kind, E, 2 * inter, D, torch.bfloat16),
                           moe.meta_experts(kind, E, D, inter, torch.bfloat16))

    def call(T):
        meta = torch.device("meta")
        return layer(torch.empty(T, D, dtype=torch.bfloat16, device=meta), torch.empty(T, k, device=meta),
                     torch.empty(T, k, dtype=torch.int32, device=meta))

    with host._StubbedLaunches() as launches:
        for T in (1, 1, 2, 1, 3, 4):
            call(T)
        assert checks == [1] and [bucket for _, bucket in lookups] == [
            f"M{m}_E{E}_N{n}_K{kk}" for m in (1, 2, 4) for n, kk in ((inter, D), (D, inter))]
        launches.count = 0
        call(1)
        assert launches.count == 1 + gemm_launches



@pytest.mark.parametrize("name", ["int4 AWQ (asym, g128)", "FP8 per-channel", "W8A8 (per-token)"])
def test_a_bare_call_does_not_keep_its_weight_alive(name):
    """int4_gemm / fp8_gemm / int8_gemm called without a Linear cache the weight's GEMM object under the weight
    (a weak key); the object holds the weight weakly, so the weight and its cache entry go when the caller drops it."""
    import gc
    import weakref

    from tritonq.kernels.fp8_gemm import fp8_gemm
    from tritonq.kernels.int8_gemm import int8_gemm
    bare = {"int4": int4.int4_gemm, "FP8": fp8_gemm, "W8A8": int8_gemm}[name.split()[0]]
    w = host.weights(256, 256)[name]
    with host._StubbedLaunches() as launches:
        bare(torch.empty(1, 256, dtype=torch.float16, device="meta"), w)
    assert launches.count == 1  # the GEMM object was built (and cached) by the call
    gone = weakref.ref(w)
    del w
    gc.collect()
    assert gone() is None
