"""The import graph of tritonq has no cycle, counting every import statement in a module, the ones
inside functions too (a function-level import can hide a cycle that a module-level one would show).

Edges: module -> every tritonq module it names in an import. `from package import name` counts as
an import of package.name when that is a module, else of the package. The implicit import of each
parent package is not an edge (tritonq/__init__.py imports the public API, which imports most of
the package, so every module would trivially close a loop through it).
"""
import ast
import importlib.util
from pathlib import Path

import tritonq

ROOT = Path(tritonq.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_sees_function_level_imports():
    graph = import_graph()
    assert "tritonq.weights" in graph["tritonq.kernels.int4_gemm"]
    assert "tritonq.formats.base" in graph["tritonq.formats.gptq"]
    assert all(importlib.util.find_spec(m) is not None for m in graph)


def test_tritonq_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_typed_weights_import_no_kernel_and_no_format():
    """Kernels and formats import tritonq.weights, so it must import neither of them."""
    imported = import_graph()["tritonq.weights"]
    assert not {m for m in imported if m.startswith(("tritonq.kernels", "tritonq.formats"))}, imported
