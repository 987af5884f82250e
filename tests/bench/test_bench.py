"""tritonq.bench: the GEMM row arithmetic, the model shape tables, and the int4_gemm CLI on CPU."""
import json
import math

import pytest

from tritonq.bench import common
from tritonq.bench import int4_gemm as bench_int4


def test_gemm_row_figures_against_h200_peaks(monkeypatch):
    monkeypatch.setattr(common, "device_peaks", lambda: ("NVIDIA H200", common.DEVICE_PEAKS["H200"]))
    # 4.8 MB in 1 us is exactly H200's 4800 GB/s; 2*1*4096*4096 FLOP in 1 us is 33.6 TFLOP/s.
    row = common.gemm_row("sq", 1, 4096, 4096, ours_ms=1e-3, baseline_ms=4e-3, bytes_moved=4_800_000)
    assert row["GB/s"] == pytest.approx(4800) and row["bw_pct"] == pytest.approx(100)
    assert row["TFLOP/s"] == pytest.approx(33.554432) and row["speedup"] == pytest.approx(4)
    assert row["roofline_pct"] == pytest.approx(100)  # memory-bound: the roofline is the bandwidth
    # Compute-bound: M=4096 square, 1 ms -> 137.4 TFLOP/s of 989: roofline 13.9 %.
    row = common.gemm_row("sq", 4096, 4096, 4096, ours_ms=1.0, baseline_ms=1.0, bytes_moved=75_497_472)
    assert row["roofline_pct"] == pytest.approx(100 * 137.438953472 / 989)


def test_model_shapes_match_the_published_configs():
    assert common.model_gemm_shapes(common.LLAMA_2_7B) == [
        ("qkv_proj", 12288, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 22016, 4096), ("down_proj", 4096, 11008)]
    # DeepSeek-V2-Lite: no q LoRA, 16 heads of 128+64, kv rank 512, 10944 dense / 1408 expert MLP.
    assert common.model_gemm_shapes(common.DEEPSEEK_V2_LITE) == [
        ("q_proj", 3072, 2048), ("kv_a_proj_with_mqa", 576, 2048), ("kv_b_proj", 4096, 512),
        ("o_proj", 2048, 2048), ("gate_up_proj", 21888, 2048), ("down_proj", 2048, 10944),
        ("expert_gate_up", 2816, 2048), ("expert_down", 2048, 1408)]
    with pytest.raises(ValueError, match="lacks"):
        common.model_gemm_shapes({"hidden_size": 8})


def test_int4_bench_cli_on_cpu_writes_json_and_plot(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU bench measures the CPU backend (kernels/cpu/lowbit.py)
    out = tmp_path / "int4.json"
    bench_int4.main(["--m", "1,3", "--square", "256", "--json", str(out), "--plot", str(tmp_path / "int4.png")])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "int4_gemm" and data["baseline"] == "torch float32 matmul (CPU)"
    assert [(r["M"], r["N"], r["K"]) for r in data["rows"]] == [(1, 256, 256), (3, 256, 256)]
    for r in data["rows"]:
        assert r["backend"] == "torch CPU kernels"
        assert r["ms"] > 0 and r["speedup"] == pytest.approx(r["baseline_ms"] / r["ms"])
    assert (tmp_path / "int4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_bench_on_cpu_compares_the_cpu_backend_with_the_references(tmp_path, monkeypatch):
    from tritonq.bench import attention as bench_attention
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU backend (kernels/cpu/attention.py)
    monkeypatch.setattr(bench_attention, "CPU_DECODE_BATCHES", (1, 3))  # small: a smoke test, not a timing
    monkeypatch.setattr(bench_attention, "CPU_LENS", (16, 40))
    monkeypatch.setattr(bench_attention, "CPU_PROMPT_LENS", (5, 33))
    out = tmp_path / "attention.json"
    bench_attention.main(["--json", str(out)])
    data = json.loads(out.read_text())
    assert data["backend"] == "torch CPU kernels" and data["baseline"].startswith("torch references")
    assert [(r["kind"], r["B"]) for r in data["rows"]] == [("decode", 1), ("decode", 3), ("write", 3),
                                                             ("prefill", 4), ("write", 4)]
    for r in data["rows"]:
        assert r["ratio"] == pytest.approx(r["reference_ms"] / r["ms"]) and r["max_err"] < 1e-4
        assert r["kind"] != "write" or r["max_err"] == 0  # a copy


def test_int4_bench_rejects_unknown_models():
    with pytest.raises(SystemExit):
        bench_int4.main(["--models", "gpt-5"])


def test_load_bench_reports_warm_and_cold_loads_of_the_same_checkpoint(tmp_path):
    from tritonq.bench import load as bench_load
    out = tmp_path / "load.json"
    bench_load.main(["--gb", "0.01", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["page_cache"] for r in rows] == ["warm", "cold"]
    for r in rows:
        assert r["linears"] == 7 and r["ratio"] == pytest.approx(r["tritonq_s"] / r["safe_open_s"])


def test_generate_bench_formats_side_by_side_on_cpu(tmp_path, monkeypatch):
    """--formats times each checkpoint format on the CPU backend and, as "before", on the references. Structure and
    values only, never speed: a decode rate is the difference of two timed runs, so on a loaded machine it may be
    nan (the 1-token run stalled past the full one, bench.generate._rates); every other figure is finite and > 0."""
    from tritonq.bench import generate as bench_generate
    monkeypatch.delenv("TRITON_INTERPRET")
    out = tmp_path / "generate.json"
    bench_generate.main(["--formats", "dense,awq,fp8", "--hidden", "128", "--intermediate", "256", "--layers", "1",
                         "--vocab", "256", "--prompt-len", "4", "--new-tokens", "3", "--reference-new-tokens", "2",
                         "--repeat", "1", "--out", str(out)])
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["dense", "awq", "fp8"]
    assert "before_decode_tok_s" not in rows["dense"] and "decode_speedup" not in rows["dense"]
    for r in rows.values():
        assert math.isfinite(r["prefill_tok_s"]) and r["prefill_tok_s"] > 0 and math.isfinite(r["load_s"])
        assert math.isnan(r["decode_tok_s"]) or (math.isfinite(r["decode_tok_s"]) and r["decode_tok_s"] > 0)
        assert r["decode_vs_dense"] == pytest.approx(r["decode_tok_s"] / rows["dense"]["decode_tok_s"], nan_ok=True)
    for r in (rows["awq"], rows["fp8"]):
        assert math.isfinite(r["before_prefill_tok_s"]) and r["before_prefill_tok_s"] > 0
        assert math.isnan(r["before_decode_tok_s"]) or (math.isfinite(r["before_decode_tok_s"]) and r["before_decode_tok_s"] > 0)
        assert r["decode_speedup"] == pytest.approx(r["decode_tok_s"] / r["before_decode_tok_s"], nan_ok=True)


@pytest.mark.parametrize("tokens", ["1", "-2"])
def test_generate_bench_refuses_a_reference_run_without_decode(tokens, capsys):
    """--reference-new-tokens 1 (or below 0) has no decode step to time: refused before any model is built, saying
    what to give instead (it divided by a zero decode rate at the end of the run before)."""
    from tritonq.bench import generate as bench_generate
    with pytest.raises(SystemExit):
        bench_generate.main(["--formats", "dense,awq", "--reference-new-tokens", tokens])
    assert "a decode rate needs at least 2 new tokens" in capsys.readouterr().err


def test_quality_bench_dense_perplexity_equals_transformers(tmp_path, monkeypatch):
    """The quality bench's dense row (tritonq forward) equals transformers' perplexity with the same windows."""
    import json

    import torch

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tritonq.bench import quality
    from tritonq.demo import DEFAULT_MODEL, HELDOUT_TEXT

    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    quality.main(["--variants", "dense", "rtn_int4_g32", "--window", "512", "--new-tokens", "2", "--repeat", "1",
                  "--out", str(tmp_path / "q")])
    rows = {r["variant"]: r for r in json.loads((tmp_path / "q.json").read_text())["rows"]}
    assert (tmp_path / "q.png").stat().st_size > 0
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer(HELDOUT_TEXT.read_text())["input_ids"])
    with torch.no_grad():
        expected = quality.window_perplexity(lambda x: hf(x).logits, ids, 512)
    assert rows["dense"]["perplexity"] == pytest.approx(expected, rel=1e-4)
    assert rows["rtn_int4_g32"]["perplexity"] == pytest.approx(expected, rel=0.05)  # int4 g32: a small change


def test_spec_bench_reports_plain_and_ngram_on_both_workloads(tmp_path, monkeypatch):
    """bench spec runs each engine on both workloads (checking greedy tokens equal to plain's) and writes rows."""
    from tritonq.bench import spec as bench_spec
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU backend, as the bench runs
    out = tmp_path / "spec.json"
    bench_spec.main(["--repeats", "1", "--new-tokens", "8", "--passage-tokens", "24", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["method"]) for r in rows] == [("repetitive", "plain"), ("repetitive", "ngram"),
                                                            ("free", "plain"), ("free", "ngram")]
    for r in rows:
        assert r["decode_tok_s"] > 0 and (r["speedup"] == 1 if r["method"] == "plain" else r["acceptance_rate"] is not None)


def test_quality_bench_kv_cache_rows_state_their_perplexity_change_and_capacity(tmp_path, monkeypatch):
    """The dense_kv_fp8 / dense_kv_int8 rows: the dense weights over 8-bit K/V (a perplexity close to dense, not
    equal), the change stated in the note, and tokens per GiB as the config's sizes count them (1 byte per K/V
    value; int8 adds one fp32 scale per layer, kv head and k / v)."""
    import json

    from tritonq import demo
    from tritonq.bench import quality

    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    quality.main(["--variants", "dense", "dense_kv_fp8", "dense_kv_int8", "--window", "128", "--max-tokens", "400",
                  "--new-tokens", "2", "--repeat", "1", "--out", str(tmp_path / "q")])
    rows = {r["variant"]: r for r in json.loads((tmp_path / "q.json").read_text())["rows"]}
    dense = rows["dense"]
    config = json.loads((demo.DEFAULT_MODEL / "config.json").read_text())
    heads = config["num_attention_heads"]
    layers_x_kv_heads = config["num_hidden_layers"] * (config.get("num_key_value_heads") or heads)
    values = layers_x_kv_heads * 2 * (config.get("head_dim") or config["hidden_size"] // heads)  # K and V per token
    scales = layers_x_kv_heads * 2  # int8: one fp32 scale per layer, kv head and k / v
    assert rows["dense_kv_fp8"]["kv_tokens_per_gib"] == 2 ** 30 // values
    assert rows["dense_kv_int8"]["kv_tokens_per_gib"] == 2 ** 30 // (values + 4 * scales)
    for name in ("dense_kv_fp8", "dense_kv_int8"):
        row = rows[name]
        assert row["perplexity"] != dense["perplexity"]  # the cache really is 8-bit
        assert row["perplexity"] == pytest.approx(dense["perplexity"], rel=0.05)
        assert f"ppl {row['perplexity'] - dense['perplexity']:+.4f} vs dense" in row["note"]


def test_moe_bench_layers_match_the_published_configs():
    """transformers' config defaults are the published Qwen3-30B-A3B and DeepSeek-V3 sizes."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    from tritonq.bench.moe import LAYERS
    qwen, v3 = Qwen3MoeConfig(), DeepseekV3Config()
    assert LAYERS["qwen3-30b-a3b"] == LAYERS["qwen3-30b-a3b"].__class__(
        qwen.num_experts, qwen.num_experts_per_tok, qwen.hidden_size, qwen.moe_intermediate_size)
    assert LAYERS["deepseek-v3"] == LAYERS["deepseek-v3"].__class__(
        v3.n_routed_experts, v3.num_experts_per_tok, v3.hidden_size, v3.moe_intermediate_size, "sigmoid", v3.n_group,
        v3.topk_group)


def test_moe_bench_cli_on_cpu_writes_json(tmp_path, monkeypatch):
    from tritonq.bench import moe as bench_moe
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU bench measures the CPU backend (kernels/cpu/lowbit.py)
    out = tmp_path / "moe.json"
    bench_moe.main(["--models", "qwen3-30b-a3b", "--tokens", "1", "3", "--experts", "2", "--rep", "1",
                    "--out", str(out)])
    data = json.loads(out.read_text())
    assert [(r["model"], r["experts"], r["weights"], r["tokens"]) for r in data["rows"]] == [
        ("qwen3-30b-a3b", 2, "int4", 1), ("qwen3-30b-a3b", 2, "int4", 3)]
    assert all(r["vs_loop"] == pytest.approx(r["loop_ms"] / r["ours_ms"]) for r in data["rows"])


def test_quality_bench_w8a8_rows_are_quantized_and_close_to_dense(tmp_path, monkeypatch):
    """W8A8 rows (int8 weights per channel, int8 activations per token; plain and SmoothQuant 0.5): the checkpoints
    the writer makes load and score. Their perplexity differs from dense (the weights and activations really are
    rounded) but by under 1%: int8 rounding moves each product by <= 1/254 of its row's range, far below the
    model's own spread of logits (the full held-out text measured -0.1%, bench/results/quality_w8a8.json)."""
    import json

    from tritonq.bench import quality
    monkeypatch.delenv("TRITON_INTERPRET")  # as the bench runs on CPU: the CPU backend, not the interpreter

    quality.main(["--variants", "dense", "w8a8_channel", "w8a8_smooth0.5", "--window", "64", "--max-tokens", "256",
                  "--new-tokens", "2", "--repeat", "1", "--samples", "4", "--seq-len", "64", "--out", str(tmp_path / "q")])
    rows = {r["variant"]: r for r in json.loads((tmp_path / "q.json").read_text())["rows"]}
    dense = rows["dense"]["perplexity"]
    for name in ("w8a8_channel", "w8a8_smooth0.5"):
        assert rows[name]["perplexity"] != dense
        assert abs(rows[name]["perplexity"] / dense - 1) < 0.01, (name, rows[name]["perplexity"], dense)


def test_gguf_bench_rows_on_cpu_and_the_llama_cpp_skip(tmp_path, monkeypatch, capsys):
    """bench gguf on a tiny Q4_K_M file: the block-format row's linears take fewer bytes than the dense row's (the
    same file dequantized to fp32; here the tied fp32 head and the mixed-type q/k/v, dense in both, weigh in), both
    rows finite; without llama-bench on PATH the
    llama.cpp row is skipped with a message saying so. Values only, never speed (a loaded machine)."""
    from formats.gguf_files import write_gguf
    from formats.test_gguf import tiny_llama
    from tritonq.bench import gguf as bench_gguf
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-bench
    path, out = tmp_path / "tiny.gguf", tmp_path / "gguf.json"
    write_gguf(tiny_llama()[0], path, "Q4_K_M")
    bench_gguf.main([str(path), "--prompt-len", "4", "--new-tokens", "3", "--batch", "2", "--repeat", "1",
                     "--out", str(out)])
    assert "llama.cpp: skipped (llama-bench is not on PATH" in capsys.readouterr().out
    rows = {r["engine"]: r for r in json.loads(out.read_text())["rows"]}
    ours, dense = rows["tritonq (block formats)"], rows["tritonq (dequantized to dense)"]
    assert ours["weight_MB"] < dense["weight_MB"]
    for r in (ours, dense):
        assert math.isfinite(r["prefill_tok_s"]) and r["offline_tok_s"] > 0
        assert math.isnan(r["decode_tok_s"]) or r["decode_tok_s"] > 0


def _llama_bench_test(n_prompt: int, n_gen: int, avg_ts: float) -> dict:
    """One test object as llama-bench (llama.cpp 0c1e57098, llama-cpp-python 0.3.36's vendored tree) prints it with
    -o json / jsonl: a subset of its fields, the ones the bench reads among others it ignores."""
    return {"build_commit": "unknown", "build_number": 0, "cpu_info": "AMD EPYC", "backends": "CPU",
            "model_type": "llama ?B Q4_K - Medium", "n_threads": 2, "n_prompt": n_prompt, "n_gen": n_gen,
            "n_depth": 0, "avg_ns": 1000, "stddev_ns": 10, "avg_ts": avg_ts, "stddev_ts": 0.5,
            "samples_ns": [1000, 1000], "samples_ts": [avg_ts, avg_ts]}


def test_llama_bench_json_and_jsonl_parse_to_decode_and_prompt_rates():
    """pp is the prompt-only test, tg the generation-only one, a combined -pg test neither; json and jsonl alike,
    log lines around the output skipped; no tests at all is an error naming the output."""
    from tritonq.bench.gguf import parse_llama_bench
    tests = [_llama_bench_test(64, 0, 512.5), _llama_bench_test(0, 32, 41.25), _llama_bench_test(64, 32, 99.0)]
    as_json = json.dumps(tests, indent=2)
    as_jsonl = "\n".join(json.dumps(t) for t in tests)
    for text in (as_json, as_jsonl, "main: log line\n" + as_json + "\n", "log [x]\n" + as_jsonl):
        out = parse_llama_bench(text)
        assert (out["pp"], out["tg"], out["n_threads"]) == (512.5, 41.25, 2), text[:40]
        assert out["build"] == "unknown (build 0)"
    only_pp = parse_llama_bench(json.dumps(tests[:1]))
    assert only_pp["pp"] == 512.5 and math.isnan(only_pp["tg"])
    for empty in ("", "[\n\n]\n", "no output"):
        with pytest.raises(ValueError, match="no test results"):
            parse_llama_bench(empty)


def test_llama_cpp_row_runs_llama_bench_with_the_torch_thread_count(tmp_path, monkeypatch):
    """A stand-in llama-bench on PATH records its arguments and prints two tests: the row carries its rates and
    thread count, and the command gave -t the engines' shared thread count, -p / -n / -r the bench's settings."""
    import argparse
    from tritonq.bench import gguf as bench_gguf
    tests = [_llama_bench_test(8, 0, 300.0), _llama_bench_test(0, 4, 20.0)]
    (tmp_path / "tests.json").write_text(json.dumps(tests))
    exe = tmp_path / "llama-bench"
    exe.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncat {tmp_path}/tests.json\n')
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + ":/bin:/usr/bin")
    args = argparse.Namespace(prompt_len=8, new_tokens=4, repeat=2)
    row = bench_gguf._llama_cpp_row("model.gguf", args, 3)
    assert row["decode_tok_s"] == 20.0 and row["prefill_tok_s"] == 300.0 and row["threads"] == 2
    assert (tmp_path / "args").read_text().split() == ["-m", "model.gguf", "-p", "8", "-n", "4", "-r", "2", "-t", "3",
                                                       "-o", "json"]
    exe.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    assert bench_gguf._llama_cpp_row("model.gguf", args, 3).startswith("llama.cpp: llama-bench failed (exit 1)")
