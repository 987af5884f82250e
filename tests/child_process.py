"""AOT compiling needs real @triton.jit functions, which TRITON_INTERPRET=1 (set by conftest)
replaces with interpreted ones, so compile tests run their script in a child process without it."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_without_interpreter(args: list[str], timeout: int = 600, first_on_path: tuple[str, ...] = ()) -> str:
    """Run `python *args` with the repo importable and TRITON_INTERPRET unset; return its stdout.
    first_on_path: folders put before everything else on sys.path (e.g. another Triton's --target install)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*first_on_path, str(ROOT), str(ROOT / "tests"),
                                                      env.get("PYTHONPATH")]))
    # its own process group: on a timeout the child's compile pool goes with it (it kept compiling, orphaned)
    child = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        raise
    assert child.returncode == 0, stderr[-3000:]
    return stdout


def json_from_child(args: list[str], timeout: int = 600, first_on_path: tuple[str, ...] = ()):
    """run_without_interpreter, reading the JSON report the child prints on its last line."""
    return json.loads(run_without_interpreter(args, timeout, first_on_path).strip().splitlines()[-1])
