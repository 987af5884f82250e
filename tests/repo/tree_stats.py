"""The package's shape in numbers, for the restructuring notes (issue 53's before/after): source files per folder
of tritonq/, the floors of tests/repo/test_import_graph.py's LAYERS and the import arrows between modules and between
folders, lines of docstring per line of code, and the places that choose a backend.

    python tests/repo/tree_stats.py [REPO]     (REPO: a checkout, default this one; its own tests/ and tritonq/ are read)

A place that chooses a backend is a call of a backend predicate (`backend`, `use_triton`, `use_cpu_kernels`) or of
the CPU C library's binding (kernels/cpu/native.py), whose None answer sends the caller to another path.
"""
from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

DECIDERS = ("backend", "use_triton", "use_cpu_kernels")
NATIVE_MODULES = ("tritonq.kernels.cpu.native", "tritonq.kernels.cpu_native")  # after / before the move
# the runtime: what `tritonq.load` and the server run (the workbench and the writer choose nothing at run time)
NOT_RUNTIME = ("bench", "tune", "check.py", "workbench.py", "random_weights.py", "demo.py", "default_model")


def docstring_lines(source: str) -> tuple[int, int, int]:
    """(docstring lines, code lines, all lines) of one Python source: docstrings of the module, classes and
    functions; code lines are the other lines that are neither blank nor only a comment."""
    tree = ast.parse(source)
    doc = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):
                doc.update(range(first.lineno, first.end_lineno + 1))
    lines = source.splitlines()
    code = sum(1 for i, line in enumerate(lines, 1)
               if i not in doc and line.strip() and not line.strip().startswith("#"))
    return len(doc), code, len(lines)


def backend_choices(source: str) -> Counter:
    """Calls that choose a backend in one Python source: {"predicate": n, "C or fallback": m}."""
    tree = ast.parse(source)
    native = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in NATIVE_MODULES:
                    native.add(alias.asname or alias.name)
    found = Counter()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in DECIDERS:
            found["predicate"] += 1
        elif isinstance(f, ast.Attribute) and f.attr in DECIDERS and isinstance(f.value, ast.Name) and f.value.id in (
                "kernels",):
            found["predicate"] += 1
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in native:
            found["C or fallback"] += 1
    return found


def stats(repo: Path) -> dict:
    package = repo / "tritonq"
    sources = [p for p in package.rglob("*") if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts
               and "default_model" not in p.relative_to(package).parts[:1]]
    per_folder = Counter(str(p.parent.relative_to(repo)) for p in sources)
    doc = code = total = 0
    choices = Counter()
    for p in sources:
        if p.suffix != ".py":
            continue
        d, c, t = docstring_lines(p.read_text())
        doc, code, total = doc + d, code + c, total + t
        if p.relative_to(package).parts[0] not in NOT_RUNTIME:
            choices.update(backend_choices(p.read_text()))
    sys.path.insert(0, str(repo / "tests" / "repo"))
    import test_import_graph as g  # this checkout's LAYERS and graph (tritonq imported from repo: PYTHONPATH)
    graph = g.import_graph()

    def folder(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 or (package / parts[-1]).is_dir() else "tritonq"

    folder_arrows = {(folder(a), folder(b)) for a, targets in graph.items() for b in targets if folder(a) != folder(b)}
    return {"files per folder": dict(sorted(per_folder.items())), "files": len(sources), "folders": len(per_folder),
            "floors": len(g.LAYERS), "modules": len(graph), "arrows": sum(len(t) for t in graph.values()),
            "folder arrows": len(folder_arrows), "docstring lines": doc, "code lines": code, "all lines": total,
            "docstring per code line": round(doc / code, 3), "docstring share of all lines": round(doc / total, 3),
            "backend choices": dict(choices), "backend choices total": sum(choices.values())}


if __name__ == "__main__":
    import json

    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else Path(__file__).resolve().parents[2]
    print(json.dumps(stats(root), indent=1))
