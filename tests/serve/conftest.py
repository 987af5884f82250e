"""The server tests' module-scoped fixtures: the tiny checkpoint a module's server serves (tests/serve/serve_util.py)
and its reference, the offline Model on the same checkpoint and backend as the server."""
import pytest


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from serve_util import tiny_checkpoint
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(checkpoint):
    import tritonq
    from serve_util import MAX_SEQ_LEN
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        yield tritonq.load(checkpoint, max_seq_len=MAX_SEQ_LEN, max_num_seqs=4)
