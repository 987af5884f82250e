"""python -m tritonq.check: run the repository's kernel tests on this machine's GPU, one line per test as it ends.

A thin wrapper over pytest, so the self-check and the test suite are the same cases with the same
tolerances (tests/tolerances.py): it runs the tests marked `kernels` (tests/kernels: every Triton
kernel against its torch reference at odd shapes; with a GPU they run natively on it) and `gpu`
(tests that need CUDA: realistic shapes, tiny models end to end, CUDA graphs), and prints, as each
test finishes (with xdist too),

    ok   <family> <test>  <seconds>s      FAIL <family> <test> (then its traceback)      skip ...

where family is the test file (int4_gemm, fp8_gemm, attention, moe, ...), then a summary. Exit status 1
if any test fails (or pytest stops early). On CUDA the tests marked `aot` (compiles for other GPUs:
they need no GPU) and `cpu_backend` (the torch CPU kernels) are left out. Without a GPU the kernel
tests run in Triton's interpreter (tests/conftest.py) and the `gpu` ones are skipped. --quick runs the
`kernels` tests only; --workers N runs them in N pytest-xdist processes (the Triton compiles of a cold
cache run in parallel); --timeout S fails a test that runs longer
(pytest-timeout); --junitxml PATH keeps pytest's JUnit XML; arguments after `--` go to pytest (e.g.
`-- -k int4`). It needs the repository's tests/ folder (a source checkout).
    python -m tritonq.check [--quick] [--workers N] [--timeout S] [--junitxml PATH] [-- PYTEST_ARGS...]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("ok", "FAIL", "skip", "xfail")
TRACEBACK_LINES = 40  # of a failure's report, streamed under its FAIL line (the JUnit XML keeps it all)


def selection(quick: bool, cuda: bool) -> str:
    """The pytest -m expression: on CUDA without the AOT compiles (no GPU needed: CI runs them) and the CPU backend."""
    chosen = "kernels" if quick else "kernels or gpu"
    return f"({chosen}) and not aot and not cpu_backend" if cuda else chosen


def pytest_args(args: argparse.Namespace, cuda: bool, have_xdist: bool,
                have_timeout: bool) -> tuple[list[str], list[str]]:
    """(pytest arguments, notes to print) for the parsed options; a wanted plugin that is missing is a note."""
    out = [str(ROOT / "tests"), "-m", selection(args.quick, cuda), "-q", "-p", "no:cacheprovider", "--tb=short"]
    notes = []
    if args.workers > 1:
        if have_xdist:
            # --dist load, not loadfile: under loadfile xdist re-runs the test a worker died on (a timeout) until
            # --max-worker-restart is spent and drops the rest of that file (pytest-xdist PR #1371)
            out += ["-n", str(args.workers), "--dist", "load"]
        else:
            notes.append(f"pytest-xdist is not installed: one process instead of --workers {args.workers}")
    if args.timeout > 0:
        if have_timeout:  # the thread method ends a hung xdist worker (even inside a CUDA call); xdist reports it
            out.append(f"--timeout={args.timeout:g}")
            if args.workers > 1 and have_xdist:
                out.append("--timeout-method=thread")
        else:
            notes.append(f"pytest-timeout is not installed: no per-test time limit "
                         f"(--timeout {args.timeout:g} ignored)")
    if args.junitxml:
        out.append(f"--junitxml={Path(args.junitxml).resolve()}")
    return out + args.pytest_args, notes


class StreamReport:
    """pytest plugin for the process that runs the session (with xdist: the controller, which receives every
    worker's reports): writes `<outcome> <family> <test>  <seconds>s` to `stream` when a test has finished
    (its teardown, or its first failing phase), and a failure's traceback indented under it."""

    def __init__(self, stream):
        self.stream = stream
        self.tests: dict[str, tuple[str, float]] = {}  # nodeid -> (outcome so far, seconds so far)

    def _write(self, outcome: str, nodeid: str, seconds: float | None, details: str = "") -> None:
        path, _, case = nodeid.partition("::")
        family = Path(path).stem.removeprefix("test_")
        text = f"{outcome:4s} {family:12s} {case or '(collecting ' + path + ')'}"
        text += f"  {seconds:.1f}s\n" if seconds is not None else "\n"
        lines = details.rstrip().splitlines()
        if len(lines) > TRACEBACK_LINES:
            lines = [f"... {len(lines) - TRACEBACK_LINES} lines above (the JUnit XML has them)",
                     *lines[-TRACEBACK_LINES:]]
        text += "".join(f"     {line}\n" for line in lines)
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the reader has gone (python -m tritonq.check was stopped): keep testing
            pass

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self._write("FAIL", report.nodeid, None, report.longreprtext)

    def pytest_runtest_logreport(self, report) -> None:
        outcome, seconds = self.tests.get(report.nodeid, ("ok", 0.0))
        seconds += report.duration
        if outcome == "FAIL":  # already written (a teardown after a failed call)
            pass
        elif report.failed:  # also xdist's report for a test whose worker died (when = "???": no teardown follows)
            outcome = "FAIL"
            died = "\n(its process died: pytest-timeout's thread method ends a test past --timeout so)" \
                if report.when == "???" else ""
            self._write(outcome, report.nodeid, seconds, report.longreprtext + died)
        elif report.skipped and outcome == "ok":
            outcome = "xfail" if hasattr(report, "wasxfail") else "skip"
        if report.when == "teardown" and outcome != "FAIL":
            self._write(outcome, report.nodeid, seconds)
        self.tests[report.nodeid] = (outcome, seconds)


def _pytest_child(argv: list[str]) -> int:
    """Runs in the pytest process: argv = [stream fd, pytest args...]. Loaded from this file by path, not as
    tritonq.check: importing the tritonq package imports triton, before tests/conftest.py has chosen the backend."""
    import pytest
    with os.fdopen(int(argv[0]), "w", encoding="utf-8") as stream:
        return int(pytest.main(argv[1:], plugins=[StreamReport(stream)]))


def run_pytest(args: list[str], on_line: Callable[[str], None] = print) -> tuple[int, Counter, str]:
    """Run pytest with `args` in a child process (cwd: the checkout), calling on_line with each test's line(s)
    as it finishes. Returns (pytest's exit status, Counter of outcomes, pytest's own output: its log)."""
    read_end, write_end = os.pipe()
    this_file = str(Path(__file__).resolve())
    # SIGINT back to KeyboardInterrupt in the child even where this process started with it ignored (a background
    # job of a non-interactive shell): `timeout -s INT` must stop pytest wherever the check was started from
    boot = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            f"sys.exit(runpy.run_path({this_file!r})['_pytest_child'](sys.argv[1:]))")
    counts: Counter = Counter()
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as log:
        child = subprocess.Popen([sys.executable, "-c", boot, str(write_end), *args], cwd=ROOT, stdout=log,
                                 stderr=subprocess.STDOUT, pass_fds=(write_end,))
        os.close(write_end)  # the child holds the only writer: the loop below ends when it exits
        # Ctrl-C or `timeout -s INT` reaches the child too (one process group): pytest then stops, writes its
        # JUnit XML and exits; until then keep relaying its lines instead of dying on the KeyboardInterrupt
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            with os.fdopen(read_end, encoding="utf-8", errors="replace") as stream:
                for line in stream:
                    word = line.split(" ", 1)[0]
                    if word in OUTCOMES:
                        counts[word] += 1
                    on_line(line.rstrip("\n"))
            returncode = child.wait()
        finally:
            signal.signal(signal.SIGINT, interrupt)
        log.seek(0)
        return returncode, counts, log.read()


def build_parser(prog: str = "python -m tritonq.check") -> argparse.ArgumentParser:
    from tritonq.cli import new_parser

    parser = new_parser(prog, __doc__.split("\n\n")[0],
                        epilog="Arguments after -- go to pytest as they are, e.g. -- -k int4 -x.")
    parser.add_argument("--quick", action="store_true", help="the `kernels` tests only (not the `gpu` ones)")
    parser.add_argument("--workers", type=int, default=1,
                        help="pytest-xdist processes (default 1: no xdist)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a test may run before it fails (pytest-timeout; 0: no limit; default 300)")
    parser.add_argument("--junitxml", default=None, help="keep pytest's JUnit XML report here")
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m tritonq.check") -> int:
    from tritonq.cli import fail, require

    argv = sys.argv[1:] if argv is None else list(argv)
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = build_parser(prog)
    args = parser.parse_args(ours)
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: expected 1 or more processes")
    args.pytest_args = extra
    if not (ROOT / "tests" / "kernels").is_dir():
        fail(parser, f"no kernel tests at {ROOT / 'tests' / 'kernels'}; it runs the repository's tests, so run it "
                     "from a source checkout of tritonq")
    require(parser, ("pytest",), "test")  # the check is pytest over tests/kernels
    import torch
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    command, notes = pytest_args(args, cuda, importlib.util.find_spec("xdist") is not None,
                                 importlib.util.find_spec("pytest_timeout") is not None)
    print(f"tritonq kernel check on {name}: pytest tests {shlex.join(command[1:])}", *notes, sep="\n", flush=True)
    start = time.perf_counter()
    returncode, counts, log = run_pytest(command, lambda line: print(line, flush=True))
    if returncode not in (0, 1) or not counts["FAIL"] and returncode:  # no test line says why: pytest's own words
        print(f"pytest exited with status {returncode}; its output ends:\n" + "\n".join(log.splitlines()[-60:]))
    print(f"{counts['ok']} passed, {counts['FAIL']} failed, {counts['skip']} skipped"
          + (f", {counts['xfail']} expected failures" if counts["xfail"] else "")
          + f" in {time.perf_counter() - start:.0f} s" + ("" if returncode in (0, 1) else " (stopped early)"),
          flush=True)
    return 0 if returncode == 0 and not counts["FAIL"] else 1


if __name__ == "__main__":
    sys.exit(main())
