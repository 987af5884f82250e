"""Issue #15's smaller points: files the sources name exist in the checkout, the benchmarks write
their default results only inside the checkout, and `python -m tritonq.check` without a GPU runs
the kernel tests through the interpreter (as its --help says) instead of refusing."""
import re
from pathlib import Path

import pytest

import tritonq.check
from tritonq.bench.common import results_path

REPO = Path(__file__).resolve().parents[2]
# a repository path in a docstring, comment, the README or docs/ (not part of a longer path); bench/results/ holds outputs
NAMED_PATH = re.compile(r"(?<![\w/.])((?:tritonq|docs|tests|bench|notebooks)/[\w/.-]+\.(?:py|md|json|ipynb))")


def test_every_file_the_sources_readme_and_docs_name_exists():
    named = {(str(path.relative_to(REPO)), found)
             for path in [*REPO.glob("tritonq/**/*.py"), REPO / "README.md", *REPO.glob("docs/*.md")]
             for found in NAMED_PATH.findall(path.read_text()) if not found.startswith("bench/results/")}
    assert len(named) > 10  # the pattern does find the paths the sources name
    missing = sorted((where, found) for where, found in named if not (REPO / found).exists())
    assert not missing, f"(file, path it names that is not in the checkout): {missing}"


def test_bench_results_default_only_inside_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a user's folder: print only, never ./bench/results there
    assert results_path("int4_gemm.json") is None
    monkeypatch.chdir(REPO / "tritonq")
    assert results_path("int4_gemm.json") == str(REPO / "bench" / "results" / "int4_gemm.json")
    assert not (tmp_path / "bench").exists()


def test_check_without_a_gpu_runs_the_kernel_tests(monkeypatch, capsys):
    """Without CUDA the check runs the kernel tests through the interpreter (no refusal), and what it says it
    runs is what --help describes; only the command is recorded here (tests/repo/test_check.py runs real cases)."""
    from collections import Counter
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    commands = []

    def run_pytest(command, on_line):
        commands.append(command)
        return 0, Counter(), ""

    monkeypatch.setattr(tritonq.check, "run_pytest", run_pytest)
    assert tritonq.check.main([]) == 0 and tritonq.check.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "refuse" not in out.lower() and "CPU (Triton interpreter)" in out
    assert [c[c.index("-m") + 1] for c in commands] == ["kernels or gpu", "kernels"]
    with pytest.raises(SystemExit):
        tritonq.check.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # --quick is an option, not the default mode
    assert "--quick the `kernels` tests only" in help_text and "refuse" not in help_text.lower()

