"""tritonq.tune: candidates are checked against the reference, winners round-trip through the
config store the launchers read, and the AOT table reports and rejects per candidate.

The int4_gemm target is exercised end to end (dry run in the interpreter, AOT for sm_90); a toy
Triton kernel stands in where a test needs a candidate that is wrong on purpose. The attention and
MoE targets' winners are read back through the launchers' own config functions, with the bucket
keys written out here by hand from the launchers' documented formats.
"""
import json
import os

import pytest
import torch
import triton
import triton.language as tl
from child_process import json_from_child, run_without_interpreter

from tritonq import tune
from tritonq.kernels import configs
from tritonq.kernels.aot import CompileReport, aot_compile


@triton.jit
def _scale_rows_kernel(x_ptr, y_ptr, N, factor, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        mask = start + offs < N
        v = tl.load(x_ptr + row * N + start + offs, mask=mask)
        tl.store(y_ptr + row * N + start + offs, v * factor, mask=mask)


def _toy_target(aot=None) -> tune.TuneTarget:
    """y = 2 x, tiled by BLOCK_N; the "WRONG" candidate multiplies by 3 and must be rejected."""
    def run(x, config):
        if config["BLOCK_N"] > 1024:
            raise ValueError("BLOCK_N too large")
        y = torch.empty_like(x)
        factor = 3.0 if config.get("WRONG") else 2.0
        _scale_rows_kernel[(x.shape[0],)](x, y, x.shape[1], factor, BLOCK_N=config["BLOCK_N"],
                                          num_warps=config["num_warps"])
        return y

    space = ({"BLOCK_N": 32, "num_warps": 1, "WRONG": True}, {"BLOCK_N": 4096, "num_warps": 4},
             {"BLOCK_N": 64, "num_warps": 2}, {"BLOCK_N": 128, "num_warps": 4})
    return tune.TuneTarget(
        name="toy", space=lambda shape: list(space), make_inputs=lambda shape, device: torch.randn(*shape, device=device),
        run=run, reference=lambda x: 2 * x, bucket=lambda x: f"M{x.shape[0]}_N{x.shape[1]}",
        aot=aot, atol=0.0, rtol=0.0, dry_run_shapes=((3, 100),), shape_format="MxN")


def test_wrong_and_failing_candidates_are_rejected_first_correct_one_wins():
    winners = tune.tune(_toy_target(), [(3, 100), (1, 17)], torch.device("cpu"), timed=False, progress=False)
    assert winners == {"M3_N100": {"BLOCK_N": 64, "num_warps": 2}, "M1_N17": {"BLOCK_N": 64, "num_warps": 2}}


def test_timed_sweep_keeps_the_fastest_correct_candidate(monkeypatch):
    """do_bench needs CUDA: a stand-in times each config by BLOCK_N; the wrong config would be fastest."""
    import triton.testing
    timed = []

    def fake_do_bench(fn, warmup, rep):
        fn()
        timed.append(fn)
        return {32: 0.1, 64: 2.0, 128: 1.0}[last_config["BLOCK_N"]]

    target = _toy_target()
    last_config = {}

    def run(x, config):
        last_config.clear()
        last_config.update(config)
        return target.run(x, config)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    winners = tune.tune(tune.TuneTarget(**{**target.__dict__, "run": run}), [(3, 100)], torch.device("cpu"),
                        timed=True, progress=False)
    assert winners == {"M3_N100": {"BLOCK_N": 128, "num_warps": 4}}
    assert len(timed) == 2  # only the two candidates that matched the reference were timed


def test_budget_cuts_each_shapes_sweep_and_keeps_the_best_so_far(monkeypatch):
    """A stand-in clock advances 1 s per timed candidate; 1.5 s over two shapes gives each ~0.75 s: after its
    first correct candidate (64, timed at 2.0 ms) a shape's share is spent, so 64 is written although 128 (1.0
    ms) would win unbudgeted; without a budget 128 wins."""
    import triton.testing
    from tritonq.tune import search
    clock = [0.0]
    target = _toy_target()

    def fake_do_bench(fn, warmup, rep):
        fn()
        clock[0] += 1.0
        return {64: 2.0, 128: 1.0}[last_config["BLOCK_N"]]

    last_config = {}

    def run(x, config):
        last_config.clear()
        last_config.update(config)
        return target.run(x, config)
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(search.time, "monotonic", lambda: clock[0])
    timed = tune.TuneTarget(**{**target.__dict__, "run": run})
    shapes = [(3, 100), (1, 17)]
    budgeted = tune.tune(timed, shapes, torch.device("cpu"), timed=True, progress=False, budget_s=1.5)
    assert budgeted == {"M3_N100": {"BLOCK_N": 64, "num_warps": 2}, "M1_N17": {"BLOCK_N": 64, "num_warps": 2}}
    assert clock[0] == 2.0
    unbudgeted = tune.tune(timed, shapes, torch.device("cpu"), timed=True, progress=False)
    assert unbudgeted == {"M3_N100": {"BLOCK_N": 128, "num_warps": 4}, "M1_N17": {"BLOCK_N": 128, "num_warps": 4}}


def test_near_default_sweeps_the_default_first_then_its_one_field_neighbours():
    """The GPU session's narrowed sweep, on the real int4_gemm space: the launcher's default first, then only the
    legal configs one field away from it: tens of candidates where the full space has hundreds."""
    from tritonq.kernels import int4_gemm
    from tritonq.tune import targets
    target = targets.int4_gemm()
    for shape in ((1, 4096, 4096), (256, 11008, 4096)):
        full = target.space(shape)
        near = tune.candidates(target, shape, timed=True, narrow=True)
        default = dict(vars(int4_gemm.default_config(*shape)))
        assert near[0] == default and 5 <= len(near) <= 30 < len(full)
        assert all(c in full and sum(c[k] != v for k, v in default.items()) == 1 for c in near[1:])
    toy = _toy_target()
    with pytest.raises(ValueError, match="toy declares no default config"):
        tune.candidates(toy, (3, 100), timed=True, narrow=True)


def test_no_correct_candidate_is_an_error():
    target = _toy_target()
    broken = tune.TuneTarget(**{**target.__dict__, "space": lambda shape: target.space(shape)[:2]})
    with pytest.raises(RuntimeError, match="no candidate of toy passed"):
        tune.tune(broken, [(3, 100)], torch.device("cpu"), timed=False, progress=False)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "CONFIG_DIR", tmp_path)
    configs.load_configs.cache_clear()
    yield tmp_path
    configs.load_configs.cache_clear()


@pytest.mark.interpreter  # tune --dry-run re-executes itself under the interpreter otherwise
def test_dry_run_cli_writes_configs_that_lookup_reads_back(config_dir, monkeypatch, capsys):
    monkeypatch.setitem(tune.TARGETS, "toy", _toy_target)
    (config_dir / "toy").mkdir()
    (config_dir / "toy" / "cpu.json").write_text(json.dumps({"M9_N9": {"BLOCK_N": 16, "num_warps": 1}}))
    tune.main(["--kernel", "toy", "--dry-run", "--shapes", "3x100", "--config-dir", str(config_dir)])
    assert configs.lookup("toy", "M3_N100") == {"BLOCK_N": 64, "num_warps": 2}
    assert configs.lookup("toy", "M9_N9") == {"BLOCK_N": 16, "num_warps": 1}  # earlier buckets are kept
    assert "rejected" in capsys.readouterr().out


@pytest.mark.interpreter  # tune --dry-run re-executes itself under the interpreter otherwise
def test_int4_gemm_dry_run_round_trips_through_the_launchers_lookup(config_dir):
    from tritonq.kernels.int4_gemm import (
        Int4GemmConfig,
        config_bucket,
        int4_gemm,
        int4_gemm_reference,
    )
    tune.main(["--kernel", "int4_gemm", "--dry-run", "--shapes", "3x40x256", "--config-dir", str(config_dir),
               "--where", "BLOCK_N=64"])
    table = json.loads((config_dir / "int4_gemm" / "cpu.json").read_text())
    target = tune.TARGETS["int4_gemm"]()
    x, w = target.make_inputs((3, 40, 256), torch.device("cpu"))
    bucket = config_bucket(3, 40, 256, w)  # the key the launcher looks up
    assert set(table) == {bucket}
    assert table[bucket] in target.space((3, 40, 256))
    tuned = configs.lookup("int4_gemm", bucket)
    assert tuned == table[bucket]
    torch.testing.assert_close(int4_gemm(x, w, config=Int4GemmConfig(**tuned)), int4_gemm_reference(x, w),
                               atol=target.atol, rtol=target.rtol)


@pytest.mark.interpreter  # tune --dry-run re-executes itself under the interpreter otherwise
def test_fp8_gemm_dry_run_round_trips_through_the_launchers_lookup(config_dir):
    from tritonq.kernels.fp8_gemm import (
        FP8GemmConfig,
        fp8_gemm,
        fp8_gemm_reference,
        tuned_config,
    )
    tune.main(["--kernel", "fp8_gemm", "--dry-run", "--shapes", "3x40x256", "--config-dir", str(config_dir),
               "--where", "BLOCK_N=32,num_warps=4,num_stages=2"])
    table = json.loads((config_dir / "fp8_gemm" / "cpu.json").read_text())
    target = tune.TARGETS["fp8_gemm"]()
    assert len(table) == 1 and next(iter(table.values())) in target.space((3, 40, 256))
    tuned = tuned_config(3, 40, 256, weight_only=False)  # what the launcher picks for this shape
    assert tuned == FP8GemmConfig(**next(iter(table.values())))
    x, w = target.make_inputs((3, 40, 256), torch.device("cpu"))
    torch.testing.assert_close(fp8_gemm(x, w, weight_only=False), fp8_gemm_reference(x, w),
                               atol=target.atol, rtol=target.rtol)


def test_aot_verdicts_reject_spills_and_shared_memory_overflow():
    reports = iter([CompileReport(90, 32768, 96, 0, True), CompileReport(90, 300_000, 128, 0, True),
                    CompileReport(90, 16384, 255, 64, False)])
    target = _toy_target(aot=lambda config, shape, cc: next(reports))
    target = tune.TuneTarget(**{**target.__dict__, "space": lambda shape: _toy_target().space(shape)[1:]})
    rows = tune.aot_table(target, (3, 100), 90)
    assert [r["verdict"] for r in rows] == ["ok", "rejected: shared memory overflow", "rejected: register spills"]
    assert rows[0]["config"] == "BN4096 w4" and rows[0]["shared_bytes"] == 32768 and rows[0]["wgmma"] is True


def _real_kernel_aot_row() -> dict:
    """aot_table over one candidate of the toy target, compiling _scale_rows_kernel for sm_90."""
    def aot(config, shape, cc):
        return aot_compile(_scale_rows_kernel, {"x_ptr": "*fp16", "y_ptr": "*fp16", "N": "i32", "factor": "fp32"},
                           {"BLOCK_N": config["BLOCK_N"]}, cc, num_warps=config["num_warps"])
    target = _toy_target(aot=aot)
    target = tune.TuneTarget(**{**target.__dict__, "space": lambda shape: _toy_target().space(shape)[2:3]})
    (row,) = tune.aot_table(target, (3, 100), 90)
    return row


def test_aot_table_compiles_a_real_kernel_for_sm90():
    # In a child process: compiling in-process under the interpreter depends on what earlier tests left patched.
    script = ("import json, sys; sys.path.insert(0, %r); import test_tune; "
              "print(json.dumps(test_tune._real_kernel_aot_row()))" % os.path.dirname(os.path.abspath(__file__)))
    row = json_from_child(["-c", script])
    assert row["verdict"] == "ok" and row["registers"] > 0 and row["spills"] == 0 and row["wgmma"] is False


def test_model_shapes_come_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 4,
        "num_key_value_heads": 2}))
    shapes = tune.model_shapes(tmp_path, ms=(1, 16))
    # head_dim 16: qkv N = (4 + 2*2) * 16 = 128; o 64x64; gate_up 320x64; down 64x160
    assert shapes == sorted((M, N, K) for M in (1, 16) for N, K in ((128, 64), (64, 64), (320, 64), (64, 160)))
    with pytest.raises(ValueError, match="no config.json"):
        tune.model_shapes(tmp_path / "missing")


@pytest.mark.interpreter  # tune --dry-run re-executes itself under the interpreter otherwise
def test_bad_arguments_are_clear_errors(capsys):
    with pytest.raises(SystemExit):
        tune.main(["--kernel", "int4_gemm", "--aot", "hopper"])
    assert "expected a compute capability" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--kernel", "attention", "--dry-run"])
    assert "invalid choice: 'attention'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--kernel", "moe", "--dry-run", "--shapes", "3x8x2x64"])
    assert "moe shapes are TxExTOPKxDxI" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--kernel", "attention_decode", "--dry-run", "--shapes", "1x64x6x4x64x64"])
    assert "multiple of kv heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--kernel", "moe", "--dry-run", "--shapes", "3x8x2x40x96"])
    assert "multiples of 32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune.main(["--kernel", "attention_prefill", "--dry-run", "--model", "somewhere"])
    assert "--model gives GEMM shapes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not int4_gemm config fields"):
        tune.main(["--kernel", "int4_gemm", "--dry-run", "--where", "BLOCKM=16"])
    with pytest.raises(ValueError, match="expected comma-separated MxNxK"):
        tune.main(["--kernel", "int4_gemm", "--dry-run", "--shapes", "16by4096"])


def test_int4_gemm_aot_cli_prints_one_row_per_candidate_for_sm90():
    """Runs as `python -m tritonq.tune` (AOT needs the real compiler, not pytest's interpreter)."""
    stdout = run_without_interpreter(["-m", "tritonq.tune", "--kernel", "int4_gemm", "--aot", "sm_90",
                                      "--shapes", "1x4096x4096", "--where", "BLOCK_N=128,BLOCK_K=32,SPLIT_K=4,num_warps=4"],
                                     timeout=300)
    rows = [line.split() for line in stdout.splitlines() if line.strip().startswith("BM16")]
    # num_stages is the only free key left: one row per value in the kernel's CONFIG_SPACE
    from tritonq.kernels.int4_gemm import CONFIG_SPACE
    assert [r[5] for r in rows] == [f"s{s}" for s in CONFIG_SPACE["num_stages"]]
    for r in rows:
        shared, registers, spills = int(r[6]), int(r[7]), int(r[8])
        assert 0 < shared <= 232448 and 0 < registers <= 255
        assert r[-1] == ("ok" if spills == 0 else "spills")  # "rejected: register spills" ends in "spills"


def test_winner_of_a_bucket_must_pass_on_all_its_shapes_and_is_the_geometric_mean_fastest(monkeypatch):
    """Two shapes share a bucket: 128 is fastest on the big shape alone, 64 over both; 32 is wrong on one."""
    import triton.testing
    base = _toy_target()
    times = {(3, 100): {32: 0.1, 64: 2.0, 128: 1.0}, (3, 1000): {32: 0.1, 64: 2.0, 128: 9.0}}
    current = {}

    def run(x, config):
        current.update(shape=tuple(x.shape), block_n=config["BLOCK_N"])
        return base.run(x, {**config, "WRONG": config["BLOCK_N"] == 32 and x.shape[1] == 1000})

    def fake_do_bench(fn, warmup, rep):
        fn()
        return times[current["shape"]][current["block_n"]]
    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    space = [{"BLOCK_N": 32, "num_warps": 1}, {"BLOCK_N": 64, "num_warps": 2}, {"BLOCK_N": 128, "num_warps": 4}]
    target = tune.TuneTarget(**{**base.__dict__, "run": run, "space": lambda shape: space,
                                "bucket": lambda x: "one bucket"})
    winners = tune.tune(target, [(3, 100), (3, 1000)], torch.device("cpu"), timed=True, progress=False)
    # geometric means: 64 -> sqrt(2 * 2) = 2, 128 -> sqrt(1 * 9) = 3; 32 failed on (3, 1000)
    assert winners == {"one bucket": {"BLOCK_N": 64, "num_warps": 2}}
    dry = tune.tune(target, [(3, 100), (3, 1000)], torch.device("cpu"), timed=False, progress=False)
    assert dry == {"one bucket": {"BLOCK_N": 64, "num_warps": 2}}  # first in order that passes on both


def test_attention_prefill_dry_run_winner_is_what_paged_prefill_config_returns(config_dir):
    from tritonq.kernels.attention import PrefillConfig, paged_prefill_config
    target = tune.TARGETS["attention_prefill"]()
    # 72 = a 64 block + a 16 tail (8 lanes masked); Dv 40 -> one 64 block
    winners = tune.tune(target, [(2, 40, 4, 2, 72, 40)], torch.device("cpu"), timed=False, progress=False,
                        where={"BLOCK_N": 64, "num_warps": 8, "num_stages": 3})
    assert winners == {"D64+16_DV64": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}}
    tune.write_configs(target.name, "cpu", winners, config_dir)
    tuned = paged_prefill_config(64, 16, 64, cc=90)
    assert tuned == PrefillConfig(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3)
    assert paged_prefill_config(64, 0, 64, cc=90) != tuned  # another bucket keeps the default


def test_attention_decode_dry_run_winner_is_what_decode_config_returns(config_dir):
    from tritonq.kernels.attention import DecodeConfig, decode_config
    target = tune.TARGETS["attention_decode"]()
    winners = tune.tune(target, [(3, 100, 8, 2, 72, 40)], torch.device("cpu"), timed=False, progress=False,
                        where={"BLOCK_N": 16, "num_warps": 8, "num_stages": 3})
    assert winners == {"D64+16_DV64": {"BLOCK_N": 16, "num_warps": 8, "num_stages": 3}}
    assert {c["BLOCK_N"] for c in target.space((3, 100, 8, 2, 72, 40))} == {16}  # key tiles within 16-token pages
    tune.write_configs(target.name, "cpu", winners, config_dir)
    # 132 SMs, 3 x 2 (sequence, kv head) programs: ceil(264 / 6) = 44 splits wanted, capped at
    # ceil(100 / (4 * 16)) = 2 so each split keeps 4 key blocks
    assert decode_config(3, 2, 100, 16, 64, 16, 64, sm_count=132) == DecodeConfig(16, 2, 8, 3)
    assert decode_config(3, 2, 4096, 16, 64, 16, 64, sm_count=132) == DecodeConfig(16, 44, 8, 3)
    # other head dims keep the default, 32-key tiles, capped by the page
    assert decode_config(3, 2, 100, 64, 128, 0, 128, sm_count=132) == DecodeConfig(32, 1, 4, 2)
    assert decode_config(3, 2, 100, 16, 128, 0, 128, sm_count=132) == DecodeConfig(16, 2, 4, 2)


def test_moe_dry_run_writes_both_gemm_buckets_that_fused_moe_looks_up(config_dir, monkeypatch):
    from tritonq.kernels import common, moe
    from tritonq.kernels.moe import MoEConfig
    target = tune.TARGETS["moe"]()
    shape = (3, 8, 2, 64, 96)  # T, E, top-k, D, I
    winners = tune.tune(target, [shape], torch.device("cpu"), timed=False, progress=False,
                        where={"num_warps": 8, "num_stages": 3})
    # gate/up: N = I = 96, K = D = 64; down: N = 64, K = 96; T = 3 rounds up to 4
    expected = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    assert winners == {"M4_E8_N96_K64": expected, "M4_E8_N64_K96": expected}
    tune.write_configs(target.name, "cpu", winners, config_dir)
    assert moe._config(3, 2, 8, 96, 64) == moe._config(3, 2, 8, 64, 96) == MoEConfig(**expected)
    assert moe.default_config(3, 2, 8) != MoEConfig(**expected)

    asked = []
    real_lookup = common.lookup
    monkeypatch.setattr(common, "lookup", lambda kernel, bucket: asked.append((kernel, bucket)) or
                        real_lookup(kernel, bucket))
    x, gate_up, down, weights, ids, _ = target.make_inputs((*shape, 0), torch.device("cpu"))
    out = moe.fused_moe(x, gate_up, down, weights, ids)
    assert sorted(asked) == sorted(("moe", bucket) for bucket in winners)  # the launch reads both entries
    torch.testing.assert_close(out, moe.fused_moe_reference(x, gate_up, down, weights, ids),
                               atol=target.atol, rtol=target.rtol)


@pytest.mark.interpreter  # tune --dry-run re-executes itself under the interpreter otherwise
def test_new_targets_dry_run_cli_round_trips(config_dir):
    """The CLI path (interpreter re-exec skipped: conftest already set it) for each new kernel."""
    for kernel, shape, where in [("attention_prefill", "1x20x2x1x16x24", "BLOCK_M=64,BLOCK_N=32,num_warps=4"),
                                 ("attention_decode", "2x33x4x4x24x16", "BLOCK_N=16,num_warps=2"),
                                 ("moe", "5x4x2x32x64", "BLOCK_N=64,BLOCK_K=64,num_warps=4")]:
        tune.main(["--kernel", kernel, "--dry-run", "--shapes", shape, "--where", where,
                   "--config-dir", str(config_dir)])
        table = json.loads((config_dir / kernel / "cpu.json").read_text())
        assert len(table) == (2 if kernel == "moe" else 1)
        for config in table.values():
            assert all(str(config[key]) == value for key, value in (w.split("=") for w in where.split(",")))


def new_targets_aot_rows() -> dict:
    """{target: aot_table rows} for sm_90 over a few candidates of one realistic shape each."""
    cases = {"attention_prefill": ((1, 4096, 32, 8, 128, 128), {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}),
             "attention_prefill_wide": ((1, 4096, 16, 16, 256, 256), {"BLOCK_M": 128, "BLOCK_N": 128,
                                                                       "num_warps": 4, "num_stages": 3}),
             "attention_decode": ((8, 4096, 32, 8, 128, 128), {"BLOCK_N": 16, "num_warps": 4}),
             "moe": ((256, 64, 6, 2048, 1408), {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8,
                                                "num_stages": 3})}
    rows = {}
    for name, (shape, where) in cases.items():
        target = tune.TARGETS[name.removesuffix("_wide")]()
        for problem in target.problems(shape):
            rows[f"{name} {problem}"] = tune.aot_table(target, problem, 90, where)
    return rows


def test_new_targets_aot_tables_for_sm90():
    script = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
              "import test_tune; print(json.dumps(test_tune.new_targets_aot_rows()))")
    tables = json_from_child(["-c", script])
    assert sorted(tables) == sorted(["attention_prefill (1, 4096, 32, 8, 128, 128)",
                                     "attention_prefill_wide (1, 4096, 16, 16, 256, 256)",
                                     "attention_decode (8, 4096, 32, 8, 128, 128)",
                                     "moe (256, 64, 6, 2048, 1408, 0)", "moe (256, 64, 6, 2048, 1408, 1)"])
    for name, rows in tables.items():
        print(name, rows)
        # where leaves num_stages free (prefill {2, 3}, decode {1, 2, 3}); moe fixes all but nothing
        assert len(rows) == {"attention_prefill": 2, "attention_decode": 3}.get(name.split()[0], 1), name
        for row in rows:
            if name.startswith("attention_prefill_wide"):
                # 128x128 tiles of 256-wide heads: K and V tiles alone exceed sm_90's 227 KiB
                assert row["shared_bytes"] > 232448 and row["verdict"] == "rejected: shared memory overflow"
                continue
            assert row["verdict"] == "ok" and row["spills"] == 0 and 0 < row["registers"] <= 255, (name, row)
            assert 0 < row["shared_bytes"] <= 232448
            # wgmma needs 64-row warpgroup tiles: prefill's 128-row blocks; decode's 16 head rows and
            # moe's 32 token rows use mma.sync
            assert row["wgmma"] == name.startswith("attention_prefill"), (name, row)
