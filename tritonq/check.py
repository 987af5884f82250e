"""python -m tritonq.check: run the repository's kernel tests on this machine's GPU and print one line each.

A thin wrapper over pytest, so the self-check and the test suite are the same cases with the same
tolerances (tests/tolerances.py): it runs the tests marked `kernels` (tests/kernels: every Triton
kernel against its torch reference at odd shapes; with a GPU they run natively on it) and `gpu`
(tests that need CUDA: realistic shapes, tiny models end to end, CUDA graphs), and prints

    ok   <family> <test>      or      FAIL <family> <test>

where family is the test file (int4_gemm, fp8_gemm, attention, moe, ...). Exit status 1 if any test
fails. Without a GPU the same kernel tests run in Triton's interpreter (tests/conftest.py) and the
`gpu` ones are skipped. --quick runs the `kernels` tests only; arguments after `--` go to pytest
(e.g. `-- -k int4`). It needs the repository's tests/ folder (a source checkout).
    python -m tritonq.check [--quick] [--json PATH] [-- PYTEST_ARGS...]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(junit_xml: Path) -> list[dict]:
    """One row per test case of pytest's JUnit report: family, case, outcome (ok / FAIL / skip)."""
    rows = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        family = case.get("classname", "").split(".")[-1].removeprefix("test_")
        outcome = ("FAIL" if case.find("failure") is not None or case.find("error") is not None else
                   "skip" if case.find("skipped") is not None else "ok")
        rows.append({"family": family, "case": case.get("name"), "outcome": outcome,
                     "seconds": float(case.get("time", 0.0))})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m tritonq.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the `kernels` tests only (not the `gpu` ones)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(ours)
    tests = ROOT / "tests"
    if not (tests / "kernels").is_dir():
        print(f"python -m tritonq.check: no kernel tests at {tests / 'kernels'}; it runs the repository's tests, "
              "so run it from a source checkout of tritonq", file=sys.stderr)
        return 2
    import torch
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (Triton interpreter)"
    print(f"tritonq kernel check on {name}: pytest -m {'kernels' if args.quick else 'kernels or gpu'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        done = subprocess.run([sys.executable, "-m", "pytest", str(tests), "-m", "kernels" if args.quick else
                               "kernels or gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                               *pytest_args], cwd=ROOT, capture_output=True, text=True)
        rows = _rows(report) if report.exists() else []
    for row in rows:
        print(f"{row['outcome']:4s} {row['family']:12s} {row['case']}")
    failed = sum(row["outcome"] == "FAIL" for row in rows)
    if done.returncode not in (0, 1) or failed:  # pytest's own failure report: what and where
        print(done.stdout[-20000:], done.stderr[-5000:], sep="\n")
    print(f"{sum(row['outcome'] == 'ok' for row in rows)} passed, {failed} failed, "
          f"{sum(row['outcome'] == 'skip' for row in rows)} skipped")
    if args.json:
        from tritonq.bench.common import write_json
        write_json(args.json, "check", rows, device=name, command=f"python -m tritonq.check {' '.join(argv)}")
    return 0 if done.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
