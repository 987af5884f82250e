"""Notebooks run as a user's would. tests/conftest.py sets TRITON_INTERPRET=1 for the whole pytest
process (the kernel tests run through Triton's interpreter on CPU), and a notebook's kernel inherits
the environment: each notebook here starts without it, on the CPU backend a user gets
(kernels.ipynb turns the interpreter on itself when there is no GPU)."""
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
