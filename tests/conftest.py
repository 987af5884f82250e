"""Test setup: run the real @triton.jit kernels on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so this runs first.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Model tests on tiny tensors: torch's thread pool only adds sync overhead (25x on a busy 2-core CI).
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
