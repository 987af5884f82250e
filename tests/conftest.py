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
