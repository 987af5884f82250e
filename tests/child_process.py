"""AOT compiling needs real @triton.jit functions, which TRITON_INTERPRET=1 (set by conftest)
replaces with interpreted ones, so compile tests run their script in a child process without it.
A module whose child takes minutes lists it in `background_children()`: tests/conftest.py starts those children
once the session is collected, one after another, and runs the module's tests last."""
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Child:
    """`python *args` with the repo importable and TRITON_INTERPRET unset (interpreter=True: as in this process, for
    a run a test could make in process), started by `start()`, `in_background` or the first `stdout()`, read later.
    first_on_path: folders put before everything else on sys.path (e.g. another Triton's --target install).
    Its output goes to temporary files (a pipe nobody reads would fill)."""

    _lock = threading.Lock()
    _started: list["Child"] = []
    _stopped = False  # stop_all ran: nothing starts any more

    def __init__(self, args: list[str], first_on_path: tuple[str, ...] = (), cwd: Path | None = None,
                 interpreter: bool = False):
        self.args, self.first_on_path, self.cwd, self.interpreter = args, first_on_path, cwd, interpreter
        self._process: subprocess.Popen | None = None
        self._stdout: str | None = None

    def start(self, nice: int = 0) -> None:
        """Start it (once), `nice` added to its scheduling niceness (its workers inherit it)."""
        with Child._lock:
            if self._process is not None or Child._stopped:
                return
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" or self.interpreter}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [*self.first_on_path, str(ROOT), str(ROOT / "tests"),
                                                              env.get("PYTHONPATH")]))
            self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            self._process = subprocess.Popen([sys.executable, *self.args], env=env, stdout=self._out,
                                             stderr=self._err, text=True, cwd=self.cwd)
            if nice:  # before the child's interpreter has started, let alone forked any worker
                os.setpriority(os.PRIO_PROCESS, self._process.pid, min(19, os.nice(0) + nice))
            Child._started.append(self)

    @staticmethod
    def in_background(children: list["Child"]) -> None:
        """Start `children` one after another, each once the one before has exited (a daemon thread), niced by 5: one
        at a time, they take the core the tests leave idle (the tests' process keeps its own: CFS gives it more than
        a core's share against two niced workers) and no more memory than one child's process pool. A child a test
        reads before its turn starts then, at full priority."""
        def run():
            for child in children:
                child.start(nice=5)
                if child._process is None:  # stopped
                    return
                child._process.wait()
        threading.Thread(target=run, daemon=True).start()

    def stdout(self, timeout: float) -> str:
        """Its stdout, starting it if need be and waiting up to `timeout` seconds more for it to exit (else it is
        killed and TimeoutExpired raised); asserts it exited 0 (the ends of its stdout and stderr otherwise)."""
        if self._stdout is None:
            self.start()
            assert self._process is not None
            try:
                self._process.wait(timeout)
            finally:
                self._kill()
            self._out.seek(0)
            self._err.seek(0)
            out = self._out.read()
            assert self._process.returncode == 0, f"{out[-6000:]}{self._err.read()[-3000:]}"
            self._stdout = out
        return self._stdout

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    @classmethod
    def stop_all(cls) -> None:
        """End every child still running and start no other (the session is over)."""
        with cls._lock:
            cls._stopped = True
            for child in cls._started:
                child._kill()


def run_without_interpreter(args: list[str], timeout: int = 600, first_on_path: tuple[str, ...] = ()) -> str:
    """Run `python *args` as a `Child` and wait for it; return its stdout."""
    return Child(args, first_on_path).stdout(timeout)


def json_from_child(args: list[str], timeout: int = 600, first_on_path: tuple[str, ...] = ()):
    """run_without_interpreter, reading the JSON report the child prints on its last line."""
    return last_json(run_without_interpreter(args, timeout, first_on_path))


def last_json(stdout: str):
    """The JSON report a child printed on its last line."""
    return json.loads(stdout.strip().splitlines()[-1])
