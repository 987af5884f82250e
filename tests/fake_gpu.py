"""pytest plugin: run the kernel tests as if on a GPU, on a machine without one (the CI fake-GPU run).

    PYTHONPATH=tests python -m pytest tests/kernels -p fake_gpu -m "kernels and not interpreter" -k "not compile"

On a GPU, tests/kernels/conftest.py makes `cuda` the default device; the interpreter run keeps `cpu`, so
a test that only works with CPU tensors (a CPU `torch.Generator` for a default-device factory call,
`.numpy()` of a device tensor, a weight built on "cpu", "cpu" in an expected message) passes in CI and
fails on the first GPU. This plugin makes the `device` fixture `meta` (tests/conftest.py asks for it), a
device that is not the CPU and has no data, and makes it behave like CUDA where meta is more lenient:

* a factory call whose generator is on another device than the tensor raises, with CUDA's message;
* a Triton launch with a meta tensor among its arguments is counted as reached instead of run
  (all-CPU launches, e.g. explicit host-check cases, still run in the interpreter);
* `torch._assert_async` is recorded: on CUDA a failing one is a device-side assert that poisons the
  context for every later test, so a test that expects an exception ("DID NOT RAISE" here) after one
  was reached is reported as such (gpu_review.md A1/D2).

What meta cannot do and CUDA can is allow-listed, narrowly (META_ONLY): reading a value back
(`.item()`, `.tolist()`, `bool()`, `.cpu()`) and the few data-dependent ops meta has no kernel for. A
test that fails with one of those is reported as xfailed ("stopped at a meta-only data access") with the
line that read the data; every other failure stays a failure. `--fake-gpu-report=PATH` writes a JSON
summary (outcomes, Triton kernels launched) for tests/repo/test_fake_gpu.py.
"""
import collections
import json
import os
import re
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: the kernels are interpreter objects (their launches stubbed)

DEVICE = torch.device("meta")

# (exception type, message pattern): the ways meta fails where CUDA has data. Nothing else is allowed.
META_ONLY = [
    (RuntimeError, r"^Tensor\.item\(\) cannot be called on meta tensors"),  # .item(), bool(), int(), float()
    (NotImplementedError, r"^Cannot copy out of meta tensor; no data!"),  # .cpu(), .tolist(), .to("cpu")
    (NotImplementedError, r"^aten::(equal|_unique2|bincount): attempted to run this operator "
                          r"with Meta tensors"),
    (NotImplementedError, r"^The register_meta function for torch\.nonzero\(\)"),  # boolean-mask indexing
    (RuntimeError, r"^cannot repeat_interleave a meta tensor without output_size"),
]


def meta_only(exc: BaseException) -> bool:
    return any(isinstance(exc, kind) and re.search(pattern, str(exc)) for kind, pattern in META_ONLY)


class GeneratorDeviceCheck(TorchFunctionMode):
    """Raises, as CUDA does, when a call's `generator` is on another device type than the tensor it fills
    (the `device` argument, else the first tensor argument's device, else the default device)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if generator is not None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            device = kwargs.get("device") or (tensors[0].device if tensors else torch.get_default_device())
            device = torch.device(device)
            if generator.device.type != device.type:
                raise RuntimeError(f"Expected a '{device.type}' device type for generator but found "
                                   f"'{generator.device.type}' (fake GPU: CUDA raises this)")
        return func(*args, **kwargs)


class Recorder:
    """Per test: the Triton kernels launched with device tensors, and the torch._assert_async calls reached."""

    def __init__(self):
        self.launches: list[str] = []
        self.device_asserts: list[str] = []
        self.outcomes: dict[str, str] = {}
        self.kernels = collections.Counter()


RECORDER = Recorder()


def _stub_launches():
    """Replace the interpreter's launch: a launch with a meta tensor argument is recorded, not run."""
    from triton.runtime.interpreter import InterpretedFunction
    run = InterpretedFunction.run

    def fake_run(self, *args, grid, warmup, **kwargs):
        values = list(args) + list(kwargs.values())
        if any(isinstance(v, torch.Tensor) and v.device.type == DEVICE.type for v in values):
            name = getattr(self.fn, "__name__", repr(self.fn))
            RECORDER.launches.append(name)
            RECORDER.kernels[name] += 1
            return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = fake_run


def _record_assert_async():
    assert_async = torch._assert_async

    def recording_assert_async(condition, *args, **kwargs):
        if isinstance(condition, torch.Tensor) and condition.device.type != "cpu":
            message = args[0] if args else kwargs.get("assert_msg", "")
            RECORDER.device_asserts.append(str(message))
        return assert_async(condition, *args, **kwargs)

    torch._assert_async = recording_assert_async


def pytest_addoption(parser):
    parser.addoption("--fake-gpu-report", default=None, help="fake_gpu: write a JSON summary of the run here")


def pytest_configure(config):
    _stub_launches()
    _record_assert_async()
    GeneratorDeviceCheck().__enter__()  # for the whole session, below the default-device contexts


def _where(excinfo) -> str:
    """The innermost frame outside torch that raised: file:line (what read the data)."""
    frames = [f for f in traceback.extract_tb(excinfo.tb)
              if f"{os.sep}torch{os.sep}" not in f.filename and f.filename != __file__]
    frame = frames[-1] if frames else traceback.extract_tb(excinfo.tb)[-1]
    return f"{os.path.relpath(frame.filename)}:{frame.lineno}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "setup":
        RECORDER.launches, RECORDER.device_asserts = [], []
    outcome = yield
    report = outcome.get_result()
    if call.when != "call":
        if report.failed:
            RECORDER.outcomes[item.nodeid] = "failed"
        elif call.when == "setup" and report.skipped:
            RECORDER.outcomes[item.nodeid] = "skipped"
        return
    launched = len(RECORDER.launches)
    report.user_properties.append(("fake_gpu_launches", launched))
    if report.failed and call.excinfo is not None:
        exc = call.excinfo.value
        if meta_only(exc):
            report.outcome = "skipped"
            report.wasxfail = (f"fake GPU: stopped at a meta-only data access at {_where(call.excinfo)} "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0][:80]}) after {launched} launches")
            RECORDER.outcomes[item.nodeid] = "meta-only"
            return
        if "DID NOT RAISE" in str(exc) and RECORDER.device_asserts:
            report.longrepr = (f"{report.longrepr}\n\nfake GPU: this test expects an exception after "
                               f"torch._assert_async was reached ({RECORDER.device_asserts[-1]!r}). On CUDA that "
                               "check is a device-side assert: no exception, and every later CUDA call in the "
                               "process fails. Put such cases on explicit CPU tensors (the host check).")
    RECORDER.outcomes[item.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = collections.Counter(RECORDER.outcomes.values())
    terminalreporter.write_line(f"fake GPU ({DEVICE.type}): {dict(sorted(counts.items()))}; "
                                f"{sum(RECORDER.kernels.values())} Triton launches reached, "
                                f"{len(RECORDER.kernels)} kernels: {sorted(RECORDER.kernels)}")
    path = config.getoption("--fake-gpu-report")
    if path:
        with open(path, "w") as f:
            json.dump({"outcomes": RECORDER.outcomes, "kernels": dict(RECORDER.kernels)}, f, indent=1)
