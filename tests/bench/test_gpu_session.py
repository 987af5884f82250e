"""bench/gpu_session.sh is run once on a lent GPU with hard limits (one command of at most 600 s, at most 8
files back from $OUT, no network), so what can be checked without a GPU is checked here: the steps' time
limits add up within the script's own cap, every `timeout` can kill, $OUT gets few files, every flag the
script passes parses with its command's own argparse parser (and each benchmark writes its JSON where the
merge reads it), and a DRY_RUN=1 run produces the merged results.json. Two sessions, each one device command:
the default (`session`) and STEP=tune (`tune_session`: tuning in at most 240 s, then benchmarks)."""
import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_session.sh"
TEXT = SCRIPT.read_text()
DEVICE_COMMAND_LIMIT = 600  # s: the device tool's limit for one command
HEADLINE_BUDGET = 420       # s: the headline steps' limits, so that a rerun fits the session's device time
MAX_FILES = 8               # files the device tool brings back from $OUT
TUNE_BUDGET = 240           # s: the tuning steps of STEP=tune (issue 50)
STEP = re.compile(r"^\s*(step|optional) (\w+) (\d+) (.+)$", re.MULTILINE)


def steps_of(function: str) -> list[tuple[str, str, int, str]]:
    """(kind, name, limit, command) of each step in the script's shell function `function`."""
    body = re.search(rf"^{function}\(\) \{{\n(.*?)^\}}", TEXT, re.MULTILINE | re.DOTALL).group(1)
    return [(kind, name, int(limit), command) for kind, name, limit, command in STEP.findall(body)]


STEPS = steps_of("session")
TUNE_STEPS = steps_of("tune_session")


def setting(name: str) -> int:
    """A NAME=<seconds> (or NAME=${NAME:-<seconds>}: the default) line of the script."""
    (value,) = re.findall(rf"^{name}=(?:\$\{{{name}:-)?(\d+)\b", TEXT, re.MULTILINE)
    return int(value)


def test_the_steps_fit_in_the_scripts_cap_and_the_cap_in_one_device_command():
    total, kill, merge = setting("TOTAL"), setting("KILL"), setting("MERGE")
    headline = [limit for kind, _, limit, _ in STEPS if kind == "step"]
    assert [name for _, name, _, _ in STEPS][:2] == ["machine", "check"]  # correctness before any benchmark
    assert len(headline) >= 4 and sum(headline) <= HEADLINE_BUDGET, headline
    # worst case: every headline step killed at its limit plus the kill grace, then the merge killed too
    assert sum(limit + kill for limit in headline) + merge + kill <= total <= DEVICE_COMMAND_LIMIT - 60
    # the optional steps run only while elapsed + limit + grace + merge fits under TOTAL (the `optional` function)
    assert "if (( $(elapsed) + $2 + KILL + MERGE + KILL > TOTAL ))" in TEXT
    assert all(limit + 2 * kill + merge <= total for kind, _, limit, _ in STEPS if kind == "optional")


def test_the_tune_session_tunes_first_within_its_budget_and_fits_one_device_command():
    total, kill, merge = setting("TOTAL"), setting("KILL"), setting("MERGE")
    names = [name for _, name, _, _ in TUNE_STEPS]
    assert names[:3] == ["machine", "tune_int4", "tune_moe"] and len(names) > 3  # tune, then benchmark with it
    assert sum(limit for _, name, limit, _ in TUNE_STEPS if name.startswith("tune")) <= TUNE_BUDGET
    assert all(kind == "step" for kind, _, _, _ in TUNE_STEPS)
    assert sum(limit + kill for _, _, limit, _ in TUNE_STEPS) + merge + kill <= total
    # each tuner stops itself (its budget) before its step's limit kills it, so the best configs so far get written
    for _, name, limit, command in TUNE_STEPS:
        if name.startswith("tune"):
            (budget,) = re.findall(r"--budget (\d+)", command)
            assert "--near-default" in command and int(budget) + 15 <= limit


def test_every_timeout_kills_and_every_step_runs_under_one():
    code = [line for line in TEXT.splitlines() if not line.lstrip().startswith("#")]
    timeouts = [line for line in code if re.search(r"(^|\s)timeout\s", line)]
    assert len(timeouts) == 2, timeouts  # the step function's and the merge's
    assert all(re.search(r"\stimeout (-s INT )?-k \S+ \S+ ", line) for line in timeouts), timeouts
    assert 'timeout -s INT -k "$KILL" "$limit" "$@"' in TEXT  # step() runs its command under its limit


def test_out_gets_at_most_eight_named_files():
    written = re.findall(r"\$out/([^\s\"']+)", TEXT) + re.findall(r'\bout / "([^"]+)"', TEXT)  # shell, merge
    assert written and all("$" not in name for name in written), written  # no per-step file names in $out
    assert len(set(written)) <= MAX_FILES, sorted(set(written))
    assert not re.search(r"\$OUT/", TEXT.replace("${OUT:-", ""))  # everything goes through $out


class Parsed(Exception):
    """Raised by the patched ArgumentParser.parse_args with the namespace, before the command does any work."""


def parse_only(monkeypatch, capsys, main, argv: list[str]) -> argparse.Namespace:
    """main(argv)'s parsed arguments; argparse's own error if it refuses them."""
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    try:
        main(argv)
    except Parsed as parsed:
        return parsed.args[0]
    except SystemExit:
        pytest.fail(f"{argv}: {capsys.readouterr().err}")
    pytest.fail(f"{argv}: the command never parsed its arguments")


def python_commands() -> list[tuple[str, str, list[str]]]:
    """(step name, module, its arguments) of every `"$py" -m MODULE ...` step; shell variables left as text."""
    commands = []
    for _, name, _, command in STEPS + TUNE_STEPS:
        words = shlex.split(command)
        if words[:2] == ["$py", "-m"]:
            commands.append((name, words[2], words[3:]))
    return commands


@pytest.mark.parametrize("name, module, argv", python_commands(),
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(python_commands())])
def test_every_flag_parses_with_the_commands_own_parser(monkeypatch, capsys, name, module, argv):
    if module == "tritonq.tune":
        import tritonq.tune.cli
        args = parse_only(monkeypatch, capsys, tritonq.tune.cli.main, argv)
        assert args.near_default and args.budget > 0 and args.shapes
        return
    if module == "tritonq.check":
        import tritonq.check
        args = parse_only(monkeypatch, capsys, tritonq.check.main, argv)
        assert args.workers > 1 and args.timeout > 0 and args.junitxml == "$out/check.xml"
        return
    assert module == "tritonq.bench", f"step {name}: {module} is none of tritonq.check, tritonq.tune, tritonq.bench"
    bench, *rest = argv
    args = parse_only(monkeypatch, capsys, importlib.import_module(f"tritonq.bench.{bench}").main, rest)
    # the merge reads $work/<step>.json: the benchmark must write its rows there
    output = getattr(args, "json", None) or getattr(args, "out", None)
    assert output == f"$work/{name}.json", (name, vars(args))


def test_dry_run_writes_the_log_and_one_merged_results_file(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DRY_RUN": "1", "OUT": str(out), "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "session.log"]  # no check.xml without a run
    results = json.loads((out / "results.json").read_text())
    assert list(results["steps"]) == [name for _, name, _, _ in STEPS]
    assert all(step["exit"] == 0 and step["result"] == {"dry_run": True} for step in results["steps"].values())
    log = (out / "session.log").read_text()
    assert log.count("=== [") >= 2 * len(STEPS) and "failed: none" in log


def test_tune_dry_run_writes_the_log_results_and_the_configs_folder(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DRY_RUN": "1", "STEP": "tune", "OUT": str(out), "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["configs", "results.json", "session.log"]
    assert list(json.loads((out / "results.json").read_text())["steps"]) == [name for _, name, _, _ in TUNE_STEPS]
    bad = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "DRY_RUN": "1", "STEP": "tunes", "OUT": str(tmp_path / "bad")})
    assert bad.returncode == 2 and "STEP=tunes: expected all (the default) or tune" in bad.stderr
