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


@pytest.mark.parametrize("argv, message", [(["--skip", "prefill"], "unknown ['prefill']"),
                                           (["--max-out", "4"], "--min-out 8 and --max-out 4")])
def test_bad_options_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_engine.main(["--quick", *argv])
    assert message in capsys.readouterr().err
