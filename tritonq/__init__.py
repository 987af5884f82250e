"""tritonq: quantized LLM inference with pure-Python Triton kernels.

    model = tritonq.load("path/or/org-name")
    model.generate("Hello", max_new_tokens=20)

`import tritonq` imports neither torch nor the runtime: `load` (tritonq.api.load), `Model` and the output
types (tritonq.api.model) and `GenerationConfig` / `EngineConfig` (tritonq.config) are imported on first use,
so `tritonq --help` and the other command lines parse their arguments before the ~2 s torch import.
Imported before torch, it makes OpenMP's idle threads sleep rather than spin (OMP_WAIT_POLICY=PASSIVE, unless set).
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

__version__ = "0.1.0"
__all__ = ["load", "Model", "GenerationConfig", "EngineConfig", "GenerationOutput", "ScoreOutput"]
# public name -> the module it lives in, imported when the name is first read
_LAZY = {"load": "tritonq.api.load", "Model": "tritonq.api.model", "GenerationOutput": "tritonq.api.model",
         "ScoreOutput": "tritonq.api.model", "GenerationConfig": "tritonq.config", "EngineConfig": "tritonq.config"}


def __getattr__(name: str):
    """tritonq.load, tritonq.Model etc.: imported (with torch) on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tritonq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


class _LogHandler(logging.Handler):
    """tritonq's log lines on stderr, at INFO and above, through tqdm.write so that a line never lands in the
    middle of a progress bar. Silent once the application configures logging itself (the root logger has a
    handler: logging.basicConfig, pytest), so nothing prints twice; TRITONQ_LOG_LEVEL=WARNING (or DEBUG)
    sets the level, TRITONQ_CONFIGURE_LOGGING=0 leaves the tritonq logger as Python's default."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def _configure_logging() -> None:
    if os.environ.get("TRITONQ_CONFIGURE_LOGGING", "1") == "0":
        return
    log = logging.getLogger("tritonq")
    handler = _LogHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    level = os.environ.get("TRITONQ_LOG_LEVEL", "INFO").upper()
    log.setLevel(level if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") else "INFO")


_configure_logging()
# OpenMP threads that wait for work sleep instead of spinning: on cores other processes share, spinning threads
# take the CPU from the ones working, and every op waits for a descheduled spinner (measured in
# docs/cli_behaviour.md: 20-80x). Read once, when torch loads OpenMP: it takes effect if tritonq is imported
# first (the `tritonq` command always is); an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
