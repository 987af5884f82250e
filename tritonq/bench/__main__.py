"""`python -m tritonq.bench NAME [options]` (`tritonq bench NAME`): run the benchmark module NAME of this package.

The list and each one's summary come from the modules' docstrings, read without importing them (each
imports torch), so `--help` and a mistyped name answer at once.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).parent
NOT_BENCHMARKS = ("common",)  # helpers, not benchmarks (and every _private module)


def benchmarks() -> dict[str, str]:
    """{module name (vs_vllm, int4_gemm, ...): one-line summary} of every benchmark module."""
    found = {}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem.startswith("_") or path.stem in NOT_BENCHMARKS:
            continue
        first = (ast.get_docstring(ast.parse(path.read_text())) or "").split("\n")[0]
        first = re.sub(r"^python -m tritonq\.bench \S+: ", "", first)  # "python -m tritonq.bench engine: what"
        first = re.sub(r": `python -m tritonq\.bench .*", ".", first)  # "What: `python -m tritonq.bench x [...]`."
        found[path.stem] = first
    return found


def build_parser(prog: str = "python -m tritonq.bench") -> argparse.ArgumentParser:
    from tritonq.cli import new_parser

    listing = "\n".join(f"  {typed(name):<10} {summary}" for name, summary in benchmarks().items())
    parser = new_parser(prog, __doc__.split("\n\n")[0], usage=f"{prog} [-h] NAME [options]",
                        epilog=f"benchmarks:\n{listing}\n\n`{prog} NAME --help` shows a benchmark's options "
                               "(- and _ alike in NAME).")
    parser.add_argument("name", metavar="NAME", help="the benchmark to run (listed below)")
    return parser


def typed(name: str) -> str:
    """How the docs spell a benchmark: vs-vllm; the others as their modules."""
    return name.replace("_", "-") if name == "vs_vllm" else name


def main(argv: list[str] | None = None, prog: str = "python -m tritonq.bench") -> None:
    from tritonq.cli import fail

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(prog)
    if not argv or argv[0].startswith("-"):  # --help (exit 0), or options before a name (exit 2)
        parser.parse_args(argv)
    names = benchmarks()
    module = argv[0].replace("-", "_")  # vs-vllm and vs_vllm alike
    if module not in names:
        fail(parser, f"unknown benchmark {argv[0]!r}; choose from {', '.join(map(typed, names))}")
    importlib.import_module(f"tritonq.bench.{module}").main(argv[1:])


if __name__ == "__main__":
    main()
