"""The import graph of tritonq has no cycle, counting every import statement in a module, the ones
inside functions too (a function-level import can hide a cycle that a module-level one would show).

Edges: module -> every tritonq module it names in an import. `from package import name` counts as
an import of package.name when that is a module, else of the package. The implicit import of each
parent package is not an edge (tritonq/__init__.py re-exports the public API, so every module would
trivially close a loop through it).

Then the layering: every module sits on one floor of LAYERS and no import points to a higher floor.
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
    assert "tritonq.quant.weights" in graph["tritonq.kernels.int4_gemm"]
    assert "tritonq.formats.base" in graph["tritonq.formats.gptq"]
    assert all(importlib.util.find_spec(m) is not None for m in graph)


def test_tritonq_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_typed_weights_import_no_kernel_and_no_format():
    """Kernels and formats import tritonq.quant.weights, so it must import neither of them."""
    imported = import_graph()["tritonq.quant.weights"]
    assert not {m for m in imported if m.startswith(("tritonq.kernels", "tritonq.formats"))}, imported


# The package's floors, bottom first. A module belongs to the entry naming it or its nearest enclosing
# package (so `tritonq.kernels` places every kernels.* module, new ones too); `tritonq` alone is the package's
# __init__. An import may point within its floor (the cycle test above guards those) or down, never up.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("typed data and plumbing", ("tritonq.quant", "tritonq.progress", "tritonq.distributed",
                                 "tritonq.eval.perplexity")),
    ("config", ("tritonq.config",)),
    ("kernels", ("tritonq.kernels",)),
    ("formats", ("tritonq.formats",)),
    ("layers", ("tritonq.formats.layers",)),
    ("models", ("tritonq.models",)),
    ("engine", ("tritonq.engine",)),
    ("model api", ("tritonq.api", "tritonq")),
    ("checkpoint writer", ("tritonq.quantize",)),
    ("command line", ("tritonq.cli", "tritonq.__main__")),
    ("server and eval", ("tritonq.serve", "tritonq.eval")),
    ("workbench", ("tritonq.workbench", "tritonq.random_weights", "tritonq.demo", "tritonq.check", "tritonq.tune",
                   "tritonq.bench", "tritonq.default_model")),
]


def layer_of(module: str) -> int | None:
    """Index in LAYERS of the entry naming module or its nearest enclosing package; None if none does."""
    floors = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}
    parts = module.split(".")
    for end in range(len(parts), 1, -1):
        if ".".join(parts[:end]) in floors:
            return floors[".".join(parts[:end])]
    return floors.get(module)  # only `tritonq` itself is named whole


def test_layer_of_matches_the_nearest_entry():
    assert layer_of("tritonq.kernels.attention.decode") == layer_of("tritonq.kernels")  # a new kernels module
    assert layer_of("tritonq.eval.perplexity") < layer_of("tritonq.api.model") < layer_of("tritonq.eval.harness")
    assert layer_of("tritonq") == layer_of("tritonq.api.load")
    assert layer_of("tritonq.newthing") is None


def test_every_module_has_a_layer():
    missing = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not missing, (f"modules without a layer: {missing}; add each to LAYERS in tests/repo/test_import_graph.py, "
                         "on the floor of the lowest module that imports it, above everything it imports")


def test_imports_point_down():
    """No import, module-level or inside a function, goes from a lower floor to a higher one: the runtime
    never imports the writer, the commands or the workbench, the kernels never the tuner."""
    upward = sorted(f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
                    for m, targets in import_graph().items() for t in targets
                    if layer_of(m) is not None and layer_of(t) is not None and layer_of(t) > layer_of(m))
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_import_tritonq_imports_no_torch():
    """`import tritonq` is cheap: load, Model and the configs are imported on first use (tritonq.__getattr__)."""
    import subprocess
    import sys

    code = ("import sys, tritonq; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert not [m for m in sys.modules if m.startswith('tritonq.')], 'a submodule imported'; "
            "assert tritonq.load.__module__ == 'tritonq.api.load' and tritonq.GenerationConfig.__module__ == "
            "'tritonq.config'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
