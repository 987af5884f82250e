"""AOT compiling needs real @triton.jit functions, which TRITON_INTERPRET=1 (set by conftest)
replaces with interpreted ones, so compile tests run their script in a child process without it.
A module whose child takes minutes starts it early as a `Child` (tests/conftest.py: `start_children`)."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class Child:
    """`python *args` with the repo importable and TRITON_INTERPRET unset, started by `start()` (or by the first
    `stdout()`) and read later. first_on_path: folders put before everything else on sys.path (e.g. another Triton's
    --target install). nice: the child's (and its workers') scheduling niceness: a child started in the background
    takes the CPU the tests running meanwhile leave idle. Its output goes to temporary files (a pipe nobody reads
    would fill)."""

    started: list["Child"] = []

    def __init__(self, args: list[str], first_on_path: tuple[str, ...] = (), nice: int = 0,
                 cwd: Path | None = None):
        self.args, self.first_on_path, self.nice, self.cwd = args, first_on_path, nice, cwd
        self._process: subprocess.Popen | None = None
        self._stdout: str | None = None

    def start(self) -> None:
        if self._process is not None:
            return
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*self.first_on_path, str(ROOT), str(ROOT / "tests"),
                                                          env.get("PYTHONPATH")]))
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        nice = self.nice
        self._process = subprocess.Popen([sys.executable, *self.args], env=env, stdout=self._out, stderr=self._err,
                                         text=True, cwd=self.cwd, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        Child.started.append(self)

    def stdout(self, timeout: float) -> str:
        """Its stdout, waiting up to `timeout` seconds more for it to exit (else it is killed and TimeoutExpired
        raised); asserts it exited 0 (the ends of its stdout and stderr in the message otherwise)."""
        if self._stdout is None:
            self.start()
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
        """End every child still running (a session cut short before its tests read them)."""
        for child in cls.started:
            child._kill()
        cls.started.clear()


def run_without_interpreter(args: list[str], timeout: int = 600, first_on_path: tuple[str, ...] = ()) -> str:
    """Run `python *args` as a `Child` and wait for it; return its stdout."""
    return Child(args, first_on_path).stdout(timeout)


def json_from_child(args: list[str], timeout: int = 600, first_on_path: tuple[str, ...] = ()):
    """run_without_interpreter, reading the JSON report the child prints on its last line."""
    return last_json(run_without_interpreter(args, timeout, first_on_path))


def last_json(stdout: str):
    """The JSON report a child printed on its last line."""
    return json.loads(stdout.strip().splitlines()[-1])
