"""tests/repo/tree_stats.py's counters against hand-counted sources, and its report on this checkout."""
from pathlib import Path

from tree_stats import backend_choices, docstring_lines, stats
from test_import_graph import LAYERS

SOURCE = '''"""Module docstring,
two lines."""
import os

# a comment

class A:
    """One line."""
    x = 1

    def f(self):
        """Three
        lines
        here."""
        return "not a docstring"
'''


def test_docstring_lines_counts_module_class_and_function_docstrings():
    # docstrings: lines 1-2, 8, 12-14 = 6; code: 3, 7, 9, 11, 15 = 5; 15 lines in all
    assert docstring_lines(SOURCE) == (6, 5, 15)


def test_backend_choices_counts_predicates_and_calls_of_the_c_binding():
    source = ("from tritonq.kernels import backend, use_triton\n"
              "from tritonq.kernels.cpu import native as cpu_native, lowbit\n"
              "def f(x):\n"
              "    if backend(x) == 'cpu' and (y := cpu_native.rms_norm(x)) is not None:\n"
              "        return lowbit.linear(x)\n"
              "    return use_triton(x) or cpu_native.library()\n")
    assert backend_choices(source) == {"predicate": 2, "C or fallback": 2}
    assert backend_choices("from tritonq.kernels import cpu_native\ncpu_native.rope(1)\n") == {"C or fallback": 1}


def test_stats_of_this_checkout():
    repo = Path(__file__).resolve().parents[2]
    found = stats(repo)
    assert found["floors"] == len(LAYERS)
    csrc = repo / "tritonq" / "kernels" / "cpu" / "csrc"
    assert found["files per folder"]["tritonq/kernels/cpu/csrc"] == len(list(csrc.glob("*.[ch]")))
    assert 0 < found["docstring lines"] < found["code lines"] and found["backend choices total"] > 0
