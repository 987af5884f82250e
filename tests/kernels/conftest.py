"""Kernel tests: every test here is marked `kernels` and creates its tensors on the `device` fixture's
device (torch's default device for the test): the GPU when there is one, so the Triton kernels run
natively, else the CPU, where they run in Triton's interpreter (or `meta` under tests/fake_gpu.py, which
CI runs). tests/kernels/cpu/ tests the CPU backend and stays on the CPU, as test_backends_agree.py (every backend
against one reference) does; the model tests place their tensors themselves (the models take a device). The CPU
backend's files are also marked `cpu_backend` (python -m tritonq.check leaves them out on CUDA).

So a test must work on any device: a seeded CPU `torch.Generator` draws on the CPU and the result is
moved (a CPU generator cannot fill a CUDA tensor); data read on the host (numpy, `.tolist()`) is made
on the CPU or copied there; weights and tables are made on the test's device, and expected messages
name it. A check of values that is `torch._assert_async` on a GPU (attention's lengths and slots) is
tested on explicit CPU tensors only: on CUDA it raises nothing and a failing one poisons the process.
"""
import pytest
import torch

def cpu_backend(path) -> bool:
    """The CPU backend's tests: tests/kernels/cpu/ and the backend harness (CPU tensors by design)."""
    return path.parent.name == "cpu" or path.name == "test_backends_agree.py"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/kernels/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.kernels)
            if cpu_backend(item.path):
                item.add_marker(pytest.mark.cpu_backend)


@pytest.fixture(autouse=True)
def _on_device(request, device):
    if cpu_backend(request.node.path) or request.node.path.name == "test_models_through_kernels.py":
        yield
        return
    before = torch.get_default_device()
    torch.set_default_device(device)
    yield
    torch.set_default_device(before)
