"""Launch-config tuner, `python -m tritonq.tune` (see cli.py for the command, search.py for the search).

A kernel declares its sweep space and AOT launch builder in its own file; targets.py builds each
kernel's `TuneTarget` from them (inputs, reference, bucket); `TARGETS` lists them by --kernel name.
"""
from tritonq.tune.cli import TARGETS, main, model_shapes

__all__ = ["TARGETS", "TuneTarget", "aot_table", "candidates", "check_candidate", "main", "model_shapes", "tune",
           "write_configs"]
_SEARCH_NAMES = ("TuneTarget", "aot_table", "candidates", "check_candidate", "tune", "write_configs")


def __getattr__(name: str):
    """search.py's names, imported (with torch) on first use: `python -m tritonq.tune --help` answers at once."""
    if name in _SEARCH_NAMES:
        from tritonq.tune import search
        return getattr(search, name)
    raise AttributeError(f"module 'tritonq.tune' has no attribute {name!r}")
