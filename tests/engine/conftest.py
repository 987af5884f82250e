"""Fixtures the engine tests share."""
import pytest


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny random Llama checkpoint (2 KV heads, untied, biases, llama3 RoPE), one per test module."""
    from models.test_llama import write_checkpoint
    folder = tmp_path_factory.mktemp("llama")
    write_checkpoint(folder, kv_heads=2, tied=False, bias=True, rope="llama3")
    return folder
