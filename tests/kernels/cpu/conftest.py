"""Fixtures of the CPU-kernel tests."""
import pytest

from tritonq.kernels.cpu import native as cpu_native


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """An empty cache folder and no library loaded yet; the process's own library comes back afterwards."""
    monkeypatch.setenv("TRITONQ_CACHE_DIR", str(tmp_path))
    cpu_native.library.cache_clear()
    yield tmp_path
    cpu_native.library.cache_clear()
