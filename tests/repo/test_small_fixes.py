"""Issue #15's smaller points: files and modules the sources name exist in the checkout, the benchmarks write
their default results only inside the checkout, and `python -m tritonq.check` without a GPU runs
the kernel tests through the interpreter (as its --help says) instead of refusing."""
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import tritonq.check
from tritonq.bench.common import results_path

REPO = Path(__file__).resolve().parents[2]
# a repository path in a docstring, comment, the README or docs/ (not part of a longer path); bench/results/ holds outputs
NAMED_PATH = re.compile(r"(?<![\w/.])((?:tritonq|docs|tests|bench|notebooks)/[\w/.-]+\.(?:py|md|json|ipynb|c|h))")
# a dotted name in the package, `tritonq.kernels.linear.LINEARS` (not part of a longer name or a path)
NAMED_MODULE = re.compile(r"(?<![\w/.-])(tritonq(?:\.[A-Za-z_]\w*)+)")


def test_every_file_the_sources_readme_and_docs_name_exists():
    named = {(str(path.relative_to(REPO)), found)
             for path in [*REPO.glob("tritonq/**/*.py"), REPO / "README.md", *REPO.glob("docs/*.md")]
             for found in NAMED_PATH.findall(path.read_text()) if not found.startswith("bench/results/")}
    assert len(named) > 10  # the pattern does find the paths the sources name
    missing = sorted((where, found) for where, found in named if not (REPO / found).exists())
    assert not missing, f"(file, path it names that is not in the checkout): {missing}"


def resolves(name: str) -> bool:
    """True if the dotted name is a module of the package, or attributes of its longest importable prefix."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:end])) is None:
                continue
        except ModuleNotFoundError:  # a name inside a module (a module is no package)
            continue
        found = importlib.import_module(".".join(parts[:end]))
        for attr in parts[end:]:
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def test_resolves_modules_and_their_attributes():
    assert resolves("tritonq.kernels.linear") and resolves("tritonq.kernels.linear.LINEARS")
    assert resolves("tritonq.load") and not resolves("tritonq.loading") and not resolves("tritonq.kernels.LINEARS")


def test_every_module_the_sources_readme_and_docs_name_imports():
    """A module or function moved leaves no name behind: every `tritonq.x.y` named in the package's sources, the
    README and docs/ imports (a module) or is an attribute of the module before it."""
    named = {(str(path.relative_to(REPO)), found)
             for path in [*REPO.glob("tritonq/**/*.py"), REPO / "README.md", *REPO.glob("docs/*.md")]
             for found in NAMED_MODULE.findall(path.read_text())}
    assert len(named) > 100  # the pattern does find the names the sources give
    missing = sorted((where, found) for where, found in named if not resolves(found))
    assert not missing, f"(file, name it gives that does not import): {missing}"


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

