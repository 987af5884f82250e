import pytest
import torch
from formats.helpers import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), torch.float16)
