"""python -m tritonq.check runs the kernel tests (pytest -m "kernels or gpu") and reports each as it ends: here a
few int4 cases through the interpreter (or natively on a GPU machine), a throwaway test folder for the streaming,
failures and time limits (in one process and under pytest-xdist), and the selection it makes on CUDA."""
import argparse
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import tritonq.check

REPO = Path(__file__).resolve().parents[2]
# Two int4_gemm cases: AWQ fp16 at M = 1 (split-K) and GPTQ with fp32 activations at M = 3.
SELECT = ["-k", "test_int4_gemm and test_kernel_matches_reference and (case0 or case5)"]


def test_check_runs_the_kernel_tests_and_reports_each(capsys):
    assert tritonq.check.main(["--quick", "--", *SELECT]) == 0
    out = capsys.readouterr().out
    assert out.count("ok   int4_gemm    test_kernel_matches_reference[case") == 2
    assert "FAIL" not in out and "2 passed, 0 failed" in out


def test_check_reports_a_wrong_kernel(tmp_path, monkeypatch, capsys):
    """A pytest plugin in the child process swaps int4_gemm for its reference times 1.05 (a 5% error)."""
    (tmp_path / "wrong_int4.py").write_text(
        "def pytest_configure(config):  # after tests/conftest.py chose the backend\n"
        "    from tritonq.kernels import int4_gemm\n"
        "    right = int4_gemm.int4_gemm_reference\n"
        "    int4_gemm.int4_gemm = lambda x, w, config=None: right(x, w) * 1.05\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    assert tritonq.check.main(["--quick", "--junitxml", str(tmp_path / "check.xml"), "--", "-p", "wrong_int4",
                               *SELECT]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL int4_gemm    test_kernel_matches_reference[case") == 2
    assert "0 passed, 2 failed" in out and "Mismatched elements" in out  # the traceback, under its FAIL line
    assert (tmp_path / "check.xml").read_text().count("Mismatched elements") >= 2  # and kept in the JUnit XML


# Throwaway test files. test_b waits until the parent has seen test_a's line, which only streaming gives.
TEST_A = "def test_a():\n    pass\n"
TEST_B = """
import os, time
def test_b():
    deadline = time.monotonic() + 30
    while not os.path.exists(os.environ["SEEN_A"]):
        assert time.monotonic() < deadline, "test_a's line did not reach python -m tritonq.check while tests ran"
        time.sleep(0.05)
"""
TROUBLE = """
import time, pytest
def test_fails():
    assert 1 + 1 == 3
def test_hangs():
    time.sleep(60)
def test_skipped():
    pytest.skip("not here")
def test_after():
    pass
"""


def run(folder: Path, *args: str, on_line=None) -> tuple[int, Counter, list[str]]:
    lines = []
    returncode, counts, _ = tritonq.check.run_pytest([str(folder), "-q", "-p", "no:cacheprovider", "--tb=short",
                                                      *args], on_line or lines.append)
    return returncode, counts, lines


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "load"]], ids=["one process", "xdist"])
def test_lines_stream_while_the_tests_run(tmp_path, monkeypatch, workers):
    if workers:
        pytest.importorskip("xdist")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(TEST_A)
    (tmp_path / "tests" / "test_b.py").write_text(TEST_B)
    seen = tmp_path / "seen_a"
    monkeypatch.setenv("SEEN_A", str(seen))
    lines = []

    def on_line(line):
        lines.append(line)
        if line.startswith("ok   a            test_a"):
            seen.touch()
    returncode, counts, _ = run(tmp_path / "tests", *workers, on_line=on_line)
    assert returncode == 0 and counts == Counter(ok=2), lines
    assert [line.split()[:3] for line in lines] == [["ok", "a", "test_a"], ["ok", "b", "test_b"]]


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "load", "--timeout-method=thread"]],
                         ids=["one process", "xdist"])
def test_failures_and_time_limits_are_reported_and_the_rest_runs(tmp_path, workers):
    """A failing test's line carries its assertion; a test past --timeout fails (under xdist its worker is ended
    and xdist reports it, once) and the tests after it still run; the JUnit XML holds every test."""
    pytest.importorskip("pytest_timeout")
    if workers:
        pytest.importorskip("xdist")
    (tmp_path / "test_trouble.py").write_text(TROUBLE)
    returncode, counts, lines = run(tmp_path, "--timeout=3", f"--junitxml={tmp_path / 'junit.xml'}", *workers)
    assert returncode == 1 and counts == Counter(ok=1, FAIL=2, skip=1), lines
    text = "\n".join(lines)
    assert "FAIL trouble      test_fails" in text and "E   assert (1 + 1) == 3" in text
    assert "FAIL trouble      test_hangs" in text and ("Timeout" in text or "its process died" in text)
    assert "skip trouble      test_skipped" in text and "ok   trouble      test_after" in text
    assert (tmp_path / "junit.xml").read_text().count("<testcase") == 4


def test_an_interrupt_as_from_timeout_keeps_what_ran(tmp_path):
    """`timeout -s INT` (gpu_session.sh's step limit) signals the whole process group: pytest stops, the JUnit XML
    keeps the tests that ran, and the check relays every line and returns pytest's status (2: interrupted)."""
    started = tmp_path / "b_started"
    (tmp_path / "test_slow.py").write_text("import pathlib, time\ndef test_a():\n    pass\ndef test_b():\n"
                                           f"    pathlib.Path({str(started)!r}).touch()\n    time.sleep(60)\n")
    driver = ("import sys, tritonq.check as check\n"
              f"code, counts, _ = check.run_pytest([{str(tmp_path)!r}, '-p', 'no:cacheprovider', "
              f"'--junitxml={tmp_path / 'junit.xml'}'], lambda line: print(line, flush=True))\n"
              "print('returned', code, dict(counts), flush=True)\n")
    # the driver starts with SIGINT ignored, as a background job of a shell (CI's runner) does: the check's pytest
    # child must still stop on it
    child = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    first = child.stdout.readline()
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:  # test_b is in its sleep (a loaded machine: wait)
        time.sleep(0.05)
    time.sleep(0.2)
    os.killpg(child.pid, signal.SIGINT)
    rest = child.stdout.read()
    assert child.wait(timeout=30) == 0
    assert first.startswith("ok   slow         test_a") and "returned 2 {'ok': 1}" in rest, first + rest
    assert 'name="test_a"' in (tmp_path / "junit.xml").read_text()


def options(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"quick": False, "workers": 1, "timeout": 300.0, "junitxml": None,
                                 "pytest_args": [], **kw})


def test_on_cuda_the_aot_and_cpu_backend_tests_are_left_out():
    args, notes = tritonq.check.pytest_args(options(), cuda=True, have_xdist=True, have_timeout=True)
    assert args[args.index("-m") + 1] == "(kernels or gpu) and not aot and not cpu_backend" and not notes
    args, _ = tritonq.check.pytest_args(options(quick=True), cuda=False, have_xdist=True, have_timeout=True)
    assert args[args.index("-m") + 1] == "kernels"  # on CPU the AOT and CPU-backend tests are kernel tests too


def test_workers_timeout_and_junit_become_pytest_options_or_a_note(tmp_path):
    chosen = options(workers=8, timeout=150.0, junitxml=str(tmp_path / "c.xml"), pytest_args=["-k", "int4"])
    args, notes = tritonq.check.pytest_args(chosen, cuda=True, have_xdist=True, have_timeout=True)
    assert " ".join(args).endswith("-n 8 --dist load --timeout=150 --timeout-method=thread "
                                   f"--junitxml={tmp_path / 'c.xml'} -k int4") and not notes
    args, notes = tritonq.check.pytest_args(chosen, cuda=True, have_xdist=False, have_timeout=False)
    assert "-n" not in args and not any(a.startswith("--timeout") for a in args)
    assert notes == ["pytest-xdist is not installed: one process instead of --workers 8",
                     "pytest-timeout is not installed: no per-test time limit (--timeout 150 ignored)"]


def test_the_markers_select_the_aot_and_cpu_backend_tests():
    """pytest -m picks them by marker: AOT compiles by their names (conftest) or an explicit `aot` mark, the CPU
    backend by its files.
    Collected in this process (a nested pytest session: the test modules are imported already)."""
    files = [str(REPO / "tests/kernels/test_cuda_numerics.py"), str(REPO / "tests/kernels/cpu/test_cpu_attention.py")]

    class Markers:
        def __init__(self):
            self.found: dict[str, set[str]] = {}  # test (parameters aside) -> its markers

        def pytest_collection_finish(self, session):
            for item in session.items:
                self.found[item.nodeid.split("[")[0]] = {mark.name for mark in item.iter_markers()}
    markers = Markers()
    assert pytest.main([*files, "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[markers]) == 0
    aot = {test for test, names in markers.found.items() if "aot" in names}
    cpu_backend = {test for test, names in markers.found.items() if "cpu_backend" in names}
    numerics = "tests/kernels/test_cuda_numerics.py::"
    assert aot == {numerics + "test_fp32_dots_are_ieee_and_half_dots_use_tensor_cores",
                   numerics + "test_activation_quantization_divides_in_ieee"}
    assert cpu_backend == {test for test in markers.found if test.startswith("tests/kernels/cpu/test_cpu_attention.py::")}
    assert all("kernels" in names for names in markers.found.values())
    kept = set(markers.found) - aot - cpu_backend  # what python -m tritonq.check runs on CUDA
    assert kept == {numerics + "test_activation_quantization_reference_is_ieee_on_cuda_too",
                    numerics + "test_grouped_topk_reference_ignores_the_default_device"}
