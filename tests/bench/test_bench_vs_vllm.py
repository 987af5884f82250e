"""tritonq.bench vs-vllm without vLLM (CI has none): the skip, the refusals, prompts, agreement and the ratio table."""
import math
import statistics
import sys

import pytest

from tritonq.bench import vs_vllm


def test_skips_with_a_message_when_no_vllm_python_is_given(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_PYTHON", raising=False)
    vs_vllm.main(["--quick"])  # returns: nothing was started
    out = capsys.readouterr().out
    assert "vs-vllm skipped" in out and "--vllm-python" in out


@pytest.mark.parametrize("python, expected", [("/no/such/python", "is not an executable file"),
                                              (sys.executable, "has no vLLM")])
def test_refuses_a_vllm_python_that_is_missing_or_lacks_vllm(python, expected, monkeypatch):
    # this environment's python has no vllm module (CI installs none); if one day it does, the case is moot
    if python == sys.executable and _has_vllm():
        pytest.skip("this python has vLLM installed")
    with pytest.raises(SystemExit, match=expected):
        vs_vllm.main(["--quick", "--vllm-python", python])


def _has_vllm() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


@pytest.mark.parametrize("argv, expected", [
    (["--min-in", "9", "--max-in", "8"], "--min-in 9 > --max-in 8"),
    (["--new-tokens", "1"], "needs >= 2"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--formats", "dense,gguf"], "unknown \\['gguf'\\]"),
    (["--workloads", "offline,chat"], "unknown \\['chat'\\]"),
    (["--rate", "0"], "--rate 0.0"),
    (["--heads", "5"], "multiple of heads"),
    (["--formats", "awq", "--hidden", "192", "--heads", "3", "--kv-heads", "1"], "multiples of 128"),
])
def test_bad_arguments_are_refused_before_any_work(argv, expected, capsys):
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--quick", *argv])
    assert expected.replace("\\", "") in capsys.readouterr().err


def test_quick_and_default_sizes_and_the_derived_limits():
    quick = vs_vllm.parse_args(["--quick", "--num-prompts", "6"])
    assert quick.num_prompts == 6 and quick.hidden == vs_vllm.QUICK["hidden"] and quick.json is None
    full = vs_vllm.parse_args(["--formats", "dense,awq"])
    assert full.dtype_of == {"dense": "float32", "awq": "bfloat16"}
    assert full.max_model_len == max(full.max_in, full.batch1_prompt_len) + max(full.new_tokens, full.server_new_tokens)
    assert full.max_num_seqs == max(full.num_prompts, full.num_requests)
    assert vs_vllm.parse_args(["--quick", "--formats", "awq", "--dtype", "float32"]).dtype_of == {
        "awq": "float32"}


def test_prompts_are_a_function_of_the_seed_and_within_bounds():
    a = vs_vllm.make_prompts(7, 20, 3, 9, 50)
    assert a == vs_vllm.make_prompts(7, 20, 3, 9, 50)  # both engines, every rerun: the same prompts
    assert a != vs_vllm.make_prompts(8, 20, 3, 9, 50)
    assert len(a) == 20 and all(3 <= len(p) <= 9 for p in a) and all(0 <= t < 50 for p in a for t in p)
    assert {len(p) for p in a} != {len(a[0])}  # the lengths vary


def test_agreement_counts_first_tokens_and_common_prefixes():
    ours = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    theirs = [[1, 2, 0], [4, 5, 6], [0, 8, 9]]
    assert vs_vllm.agreement(ours, theirs) == {"first_token": pytest.approx(2 / 3),
                                               "mean_common_prefix": pytest.approx((2 + 3 + 0) / 3)}
    with pytest.raises(ValueError, match="same prompts"):
        vs_vllm.agreement(ours, theirs[:2])


def test_ratio_rows_take_the_median_per_engine_and_divide():
    def m(workload, metric, engine, value):
        return {"format": "dense", "workload": workload, "metric": metric, "engine": engine, "value": value}
    ours, theirs = [50.0, 70.0, 60.0], [100.0, 90.0, 300.0]
    measurements = [m("offline", "output_tok_s", "tritonq", v) for v in ours]
    measurements += [m("offline", "output_tok_s", "vllm", v) for v in theirs]
    measurements += [m("server", "ttft_p50_ms", "tritonq", 30.0), m("server", "ttft_p50_ms", "vllm", 20.0)]
    measurements += [m("batch1", "decode_tok_s", "tritonq", float("nan")), m("batch1", "decode_tok_s", "tritonq", 8.0),
                     m("batch1", "decode_tok_s", "vllm", 4.0)]
    rows = {r["workload"]: r for r in vs_vllm.ratio_rows(measurements)}
    offline = rows["offline"]
    assert offline["tritonq"] == statistics.median(ours) == 60.0 and offline["vllm"] == 100.0
    assert offline["tritonq/vllm"] == pytest.approx(0.6) and offline["better"] == "higher"
    assert offline["tritonq_runs"] == ours and offline["vllm_runs"] == theirs
    assert rows["server"]["tritonq/vllm"] == pytest.approx(1.5) and rows["server"]["better"] == "lower"
    assert rows["batch1"]["tritonq"] == 8.0 and rows["batch1"]["tritonq/vllm"] == 2.0  # the NaN round is left out
    only_nan = vs_vllm.ratio_rows([m("batch1", "decode_tok_s", "tritonq", 1.0),
                                   m("batch1", "decode_tok_s", "vllm", float("nan"))])
    assert math.isnan(only_nan[0]["vllm"]) and math.isnan(only_nan[0]["tritonq/vllm"])
    with pytest.raises(ValueError, match="unknown engine"):
        vs_vllm.ratio_rows([m("offline", "output_tok_s", "sglang", 1.0)])


def test_rounds_alternate_who_goes_first():
    assert [vs_vllm.round_order(r) for r in range(3)] == [("tritonq", "vllm"), ("vllm", "tritonq"),
                                                         ("tritonq", "vllm")]


def test_every_id_of_the_word_tokenizer_decodes_to_its_own_text():
    tok = vs_vllm.word_tokenizer(40)
    texts = [tok.decode([i]) for i in range(40)]
    assert all(texts) and len(set(texts)) == 40  # each token streams a non-empty chunk
    assert tok.encode(" ".join(texts), add_special_tokens=False) == list(range(40))


def test_settle_waits_while_another_process_keeps_a_core_busy():
    """A timed run starts on a quiet machine: while a child spins a core for 1.2 s, busy_cores sees at least half a
    core busy and settle waits at least until the child ends (other load only makes it wait longer, up to its
    limit)."""
    import subprocess
    import sys
    import time
    if vs_vllm.busy_cores(0.01) is None:
        pytest.skip("no /proc/stat on this system: settle returns at once")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.2\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.1)
        assert vs_vllm.busy_cores(0.3) >= 0.5
        waited = vs_vllm.settle(limit_s=6.0)
        assert waited >= 0.6 and spin.poll() is not None
    finally:
        spin.kill()
        spin.wait()
