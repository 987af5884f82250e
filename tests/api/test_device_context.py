"""#34 B1 / B4: work runs on the model's CUDA device, whichever device the thread has current.

Triton takes a launch's device and stream from torch's current CUDA device (cuda:0 in any thread that
never set one), so every Triton launch must enter its tensors' device, and the server's engine thread
must set the model's. Without a GPU: tensors that claim to be on cuda:1 (a Tensor subclass) and
torch.cuda's device functions replaced by recorders, plus a structural check that every Triton launch
in the package goes through `kernels.common.Launch`. B4: `load(device="cuda")` under torchrun means
GPU LOCAL_RANK, and CUDA graphs are off by default under tensor parallelism.
"""
import ast
import contextlib
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tritonq
from tritonq import distributed
from tritonq.kernels.common import Launch

PACKAGE = Path(tritonq.__file__).parent


class OnCuda1(torch.Tensor):
    """A CPU tensor that reports device cuda:1 (what Launch reads to pick the device)."""
    @property
    def device(self):
        return torch.device("cuda", 1)


@pytest.fixture
def current_device(monkeypatch):
    """torch.cuda.device / set_device replaced by recorders of a per-test "current device" stack."""
    stack = [torch.device("cuda", 0)]

    @contextlib.contextmanager
    def device(d):
        stack.append(torch.device(d))
        try:
            yield
        finally:
            stack.pop()

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: stack.__setitem__(-1, torch.device(d)))
    return stack


class KernelSpy:
    """Stands in for a @triton.jit kernel: records the current device at each launch."""
    def __init__(self, stack):
        self.stack, self.launched_on = stack, []

    def __getitem__(self, grid):
        return lambda **kwargs: self.launched_on.append(self.stack[-1])


def test_launch_runs_on_its_tensors_device_not_the_current_one(current_device):
    spy = KernelSpy(current_device)
    x = torch.zeros(4).as_subclass(OnCuda1)
    Launch(spy, (1,), dict(x_ptr=x, n=4, BLOCK=16), 4, 3)()
    assert spy.launched_on == [torch.device("cuda", 1)]
    assert current_device == [torch.device("cuda", 0)]  # left as it was


def test_launch_on_cpu_tensors_enters_no_cuda_device(current_device):
    spy = KernelSpy(current_device)
    Launch(spy, (1,), dict(x_ptr=torch.zeros(4), n=4), 4, 3)()
    assert spy.launched_on == [torch.device("cuda", 0)]  # nothing entered (the interpreter has no device)


def _jit_kernel_names() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
    return names


def test_every_triton_launch_goes_through_launch():
    """A `kernel[grid](...)` call anywhere but Launch.__call__ would launch on the current device."""
    kernels = _jit_kernel_names()
    assert {"_write_slots_kernel", "_int4_gemm_kernel", "_rms_norm_kernel"} <= kernels  # the reader finds them
    direct = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                target = node.func.value
                name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
                if name in kernels or name == "kernel":
                    direct.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    source = (PACKAGE / "kernels" / "common.py").read_text().splitlines()
    launch_call = next(i for i, line in enumerate(source, 1) if "self.kernel[grid or self.grid](" in line)
    assert direct == [f"tritonq/kernels/common.py:{launch_call}"]  # Launch.__call__ only


def test_engine_thread_sets_the_models_device(current_device):
    """The current CUDA device is per thread: the server's engine thread sets the model's before any step."""
    from tritonq.engine.multiplexer import Multiplexer
    from tritonq.serve.engine_loop import EngineLoop

    seen = []
    engine = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cuda", 1)),
                             has_unfinished=lambda: seen.append(current_device[-1]) or False)
    loop = EngineLoop(Multiplexer(engine), metrics=None)
    loop._thread.start()
    loop.stop()
    assert loop.dead is None and seen and set(seen) == {torch.device("cuda", 1)}


# ---------------------------------------------------------------------------------------------------
# B4: the device under torchrun, CUDA graphs under tensor parallelism
# ---------------------------------------------------------------------------------------------------

def test_cuda_without_index_is_local_rank_under_torchrun(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.resolve_device("cuda") == torch.device("cuda", 1)
    assert distributed.resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert distributed.resolve_device("cuda:3") == torch.device("cuda", 3)  # an explicit index is kept
    assert distributed.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert distributed.resolve_device("cuda") == torch.device("cuda", 2)  # outside torchrun: the current GPU


def test_load_joins_the_process_group_on_gpu_local_rank(monkeypatch):
    """load(device="cuda", tensor_parallel=2) on rank 1 of torchrun: the group is joined with cuda:1 (plain
    "cuda" is GPU 0 on every rank, which NCCL refuses as a duplicate GPU)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    given = []

    def init_tensor_parallel(tensor_parallel, device):
        given.append(device)
        raise InterruptedError("stop here")
    monkeypatch.setattr(distributed, "init_tensor_parallel", init_tensor_parallel)
    with pytest.raises(InterruptedError):
        tritonq.load(PACKAGE / "default_model" / "checkpoint", device="cuda", tensor_parallel=2)
    assert given == [torch.device("cuda", 1)]


def test_cuda_graphs_default_off_under_tensor_parallelism(caplog):
    from tritonq.api.load import _capture_graphs

    assert _capture_graphs(None, 1) is True
    with caplog.at_level(logging.INFO, logger="tritonq"):
        assert _capture_graphs(None, 2) is False
    assert "CUDA graphs off by default under tensor parallelism" in caplog.text
    assert _capture_graphs(True, 2) is True and _capture_graphs(False, 1) is False
