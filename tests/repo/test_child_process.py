"""tests/child_process.py's Child, which the slow compile tests start in the background: its output read later
(past a pipe's 64 KB), without TRITON_INTERPRET, niced when asked; a failure or a time limit is an error that
shows the child's output, and a child past its time is ended; children in the background run one at a time.
tests/conftest.py runs the tests of the modules that have such children last."""
import os
import subprocess
import sys
import time

import pytest
from child_process import Child


def test_a_child_runs_without_the_interpreter_and_its_output_is_read_later():
    child = Child(["-c", "import os, sys; sys.stdout.write('x' * 200_000 + '\\n'); "
                         "print(os.nice(0), os.environ.get('TRITON_INTERPRET'))"])
    child.start(nice=7)
    lines = child.stdout(timeout=60).splitlines()
    assert lines == ["x" * 200_000, f"{min(os.nice(0) + 7, 19)} None"]  # niceness adds to this process's


def test_a_failing_child_raises_with_the_end_of_its_output():
    child = Child(["-c", "import sys; print('said before'); sys.exit('the reason')"])
    with pytest.raises(AssertionError, match="(?s)said before.*the reason"):
        child.stdout(timeout=60)


def test_a_child_past_its_time_is_ended():
    child = Child(["-c", "import time; time.sleep(60)"])
    with pytest.raises(subprocess.TimeoutExpired):
        child.stdout(timeout=0.5)
    assert child._process.returncode is not None


def test_background_children_run_one_after_another():
    children = [Child(["-c", "import os, time; print(time.time(), os.nice(0)); time.sleep(1); print(time.time())"])
                for _ in range(2)]
    Child.in_background(children)
    while children[0]._process is None:  # started by the background thread (stdout() would start it itself)
        time.sleep(0.01)
    (_, nice, first_end), (second_start, _, _) = (map(float, child.stdout(timeout=60).split()) for child in children)
    assert second_start >= first_end and nice == min(os.nice(0) + 5, 19)


def test_the_tests_of_modules_with_background_children_run_last():
    """tests/conftest.py moves the tests of a module with background_children() (test_sass here) after all others."""
    from child_process import ROOT
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/aot/test_sass.py", "tests/repo/test_child_process.py"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300).stdout
    files = [line.split("::")[0] for line in listed.splitlines() if "::" in line]
    assert files == sorted(files, key=lambda f: f.endswith("test_sass.py")) and files[-1].endswith("test_sass.py")
    assert files[0].endswith("test_child_process.py")
