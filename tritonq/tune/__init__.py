"""Launch-config tuner, `python -m tritonq.tune` (see cli.py for the command, search.py for the search).

Generic: what a kernel tunes (its sweep space, inputs, reference, bucket and AOT launch) is declared in
the kernel's own file by `tune_target()`; `TARGETS` lists them by --kernel name.
"""
from tritonq.tune.cli import TARGETS, main, model_shapes
from tritonq.tune.search import TuneTarget, aot_table, candidates, check_candidate, tune, write_configs

__all__ = ["TARGETS", "TuneTarget", "aot_table", "candidates", "check_candidate", "main", "model_shapes", "tune",
           "write_configs"]
