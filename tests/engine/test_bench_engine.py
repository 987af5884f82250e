"""`python -m tritonq.bench engine --quick` (made smaller still) runs every part and writes its JSON."""
import json

import pytest

from tritonq.bench import engine as bench_engine

pytestmark = pytest.mark.usefixtures("one_thread")


def test_quick_bench_writes_every_row_and_ratios_of_its_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")  # the CLI times the torch path on CPU, not the interpreter
    out = tmp_path / "engine.json"
    bench_engine.main(["--quick", "--num-prompts", "9", "--hidden", "64", "--layers", "1", "--vocab", "300",
                       "--max-in", "40", "--min-out", "2", "--max-out", "6", "--prefix-prompts", "3", "--system-len", "32",
                       "--prefix-repeats", "2", "--prefix-alone", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "engine" and data["quick"] and data["num_prompts"] == 9
    rows = {row["run"]: row for row in data["rows"]}
    engine, static8 = rows["engine"], rows["static8 (tritonq, batches of 8)"]
    hf = rows["transformers (padded batches of 8)"]
    for run in (engine, static8, hf):
        assert run["seconds"] > 0 and run["cpu_seconds"] > 0
        assert run["output_tok_s"] == pytest.approx(engine["output_tok_s"] * engine["seconds"] / run["seconds"])
    assert rows["engine / static8"]["ratio"] == pytest.approx(engine["output_tok_s"] / static8["output_tok_s"])
    assert rows["engine / transformers"]["cpu_ratio"] == pytest.approx(engine["cpu_output_tok_s"]
                                                                       / hf["cpu_output_tok_s"])
    for kind, what in (("burst", "3 prompts submitted at once"), ("alone", "2 prompts one at a time")):
        off, on = rows[f"prefix off, {what}: mean TTFT"], rows[f"prefix on, {what}: mean TTFT"]
        ratio = rows[f"prefix TTFT off / on, {kind}"]
        assert ratio["ratio"] == pytest.approx(off["seconds"] / on["seconds"])
        assert len(ratio["ratios_per_repeat"]) == 2
    # the warm-up puts the 32-token system prompt (2 blocks) in the cache; every timed prompt hits both
    # and nothing else (fresh suffixes each repeat): 2 repeats x (3 + 2) prompts x 32 tokens
    served = rows["prefix on: prompt tokens served from the cache"]
    assert served["hits"] == 2 * 5 * 32
    assert "engine / static8" in capsys.readouterr().out


def test_null_model_bench_reports_host_time_per_step_and_sequence(tmp_path, capsys):
    """CLI smoke test of --null-model (no timing assertion: the numbers depend on the machine)."""
    out = tmp_path / "null.json"
    bench_engine.main(["--null-model", "--batch-sizes", "1,3", "--null-steps", "2", "--null-prompt-len", "20",
                       "--repeats", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(row["batch"], row["run"].split(", ")[-1]) for row in rows] == [
        (b, what) for b in (1, 3) for what in ("repetition_penalty 1.0", "repetition_penalty 1.1",
                                               "streamed (detokenized every step)")]
    for row in rows:
        assert row["step_us"] > 0 and row["seq_us"] == pytest.approx(row["step_us"] / row["batch"])
        assert len(row["step_us_per_repeat"]) == 2
    assert "null model, batch 3" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench_engine.main(["--null-model", "--batch-sizes", "1,x"])


@pytest.mark.parametrize("argv, message", [(["--skip", "prefill"], "unknown ['prefill']"),
                                           (["--max-out", "4"], "--min-out 8 and --max-out 4")])
def test_bad_options_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_engine.main(["--quick", *argv])
    assert message in capsys.readouterr().err
