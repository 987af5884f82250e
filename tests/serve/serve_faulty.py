"""`python tests/serve/serve_faulty.py MODEL ARGS...`: `python -m tritonq.serve` with ModelRunner.run patched
to fail on demand, for the fault-injection tests (tests/serve/test_serve_bad_input.py).

TRITONQ_TEST_FAULT_FILE names a file. While it does not exist, run is the real one. At the first run
call that finds it, the file is removed (one shot) and its content says what that call does:
"raise" sleeps FAULT_SLEEP_S (so requests arrive during the failing step) and raises RuntimeError;
"dead" raises what a broken CUDA context raises (the engine must declare itself dead).
Engine.add_checked is patched the same way: "add NAME" makes the next add raise the exception type NAME (one of
serve.errors.STATUSES' types, or KeyError for one of no status: a 500), with the message "injected NAME", on the
engine thread as the engine's own refusal or failure would (tests/serve/test_errors.py).
"""
import os
import sys
import time

from tritonq.engine.engine import Engine
from tritonq.engine.runner import ModelRunner

FAULT_FILE = os.environ["TRITONQ_TEST_FAULT_FILE"]
FAULT_SLEEP_S = 1.0
_real_run = ModelRunner.run
_real_add = Engine.add_checked


def _armed(prefix: str) -> str | None:
    """The armed fault if it starts with prefix (then disarmed: one shot), else None."""
    try:
        with open(FAULT_FILE) as f:
            kind = f.read().strip()
    except FileNotFoundError:
        return None
    if not kind.startswith(prefix):
        return None
    os.remove(FAULT_FILE)
    return kind


def _add_checked(self, checked, **options):
    kind = _armed("add ")
    if kind is None:
        return _real_add(self, checked, **options)
    from tritonq.serve.errors import STATUSES
    name = kind.removeprefix("add ")
    raise {t.__name__: t for t, _ in STATUSES}.get(name, KeyError)(f"injected {name}")


def _run(self, ctx):
    try:
        with open(FAULT_FILE) as f:
            kind = f.read().strip()
    except FileNotFoundError:
        kind = None
    if kind not in ("raise", "dead"):  # none armed (the tests replace the file atomically)
        return _real_run(self, ctx)
    os.remove(FAULT_FILE)
    if kind == "dead":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected device error)")
    time.sleep(FAULT_SLEEP_S)
    raise RuntimeError("injected fault in ModelRunner.run")


ModelRunner.run = _run
Engine.add_checked = _add_checked

if __name__ == "__main__":
    from tritonq.serve.__main__ import main
    main(sys.argv[1:])
