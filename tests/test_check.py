"""python -m tritonq.check runs the kernel tests (pytest -m "kernels or gpu") and reports each; here a
few int4 cases through the interpreter (or natively on a GPU machine)."""
import os

import tritonq.check

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
    assert tritonq.check.main(["--quick", "--", "-p", "wrong_int4", *SELECT]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL int4_gemm    test_kernel_matches_reference[case") == 2
    assert "0 passed, 2 failed" in out and "Mismatched elements" in out
