"""Issue #15's smaller points: files the sources name exist in the checkout, the benchmarks write
their default results only inside the checkout, and `python -m tritonq.check` without a GPU runs
its --quick cases (as its --help says) instead of refusing."""
import re
from pathlib import Path

import tritonq.check
from tritonq.bench.common import results_path

REPO = Path(__file__).resolve().parents[1]
# a repository path in a docstring, comment or README (not part of a longer path); bench/results/ holds outputs
NAMED_PATH = re.compile(r"(?<![\w/.])((?:tritonq|docs|tests|bench|notebooks)/[\w/.-]+\.(?:py|md|json|ipynb))")


def test_every_file_the_sources_and_readme_name_exists():
    named = {(str(path.relative_to(REPO)), found) for path in [*REPO.glob("tritonq/**/*.py"), REPO / "README.md"]
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


def test_check_without_a_gpu_runs_the_quick_cases(monkeypatch, capsys):
    """The check's cases are replaced by one that records `quick`: only the mode choice is tested here
    (tests/test_check.py runs the real quick cases)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    modes = []

    def cases(device, quick):
        modes.append((device, quick))
        return iter(())

    monkeypatch.setattr(tritonq.check, "_cases", cases)
    monkeypatch.setattr(tritonq.check, "_model_cases", cases)
    assert tritonq.check.main([]) == 0
    assert modes == [("cpu", True), ("cpu", True)]
    assert "refuse" not in capsys.readouterr().out.lower()

