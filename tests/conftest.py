"""Test setup: where the real @triton.jit kernels run.

With a CUDA GPU they run natively: the kernel tests (tests/kernels, marked `kernels`) put their
tensors on it through the `device` fixture. Without one they run on CPU through Triton's
interpreter: TRITON_INTERPRET must be set before triton is first imported, so this runs first
(`import torch` does not import triton). Markers (pyproject): `gpu` tests need CUDA and are skipped
without it; `interpreter` tests exercise the interpreter path itself (CPU tensors through the
Triton kernels, `tune --dry-run` in process) and are skipped where kernels run natively. Tests named
`*_compile(s)_*` or `*_aot_*` compile kernels ahead of time for GPUs we may not have and are marked
`aot` (no GPU needed: python -m tritonq.check leaves them out on CUDA).
`-p fake_gpu` (tests/fake_gpu.py, on PYTHONPATH=tests) makes the `device` fixture `meta` instead: the kernel
tests as on a GPU, without one (tests/repo/test_fake_gpu.py runs them so in CI).
"""
import os
import re
import sys
from pathlib import Path

import torch

# tests/serve/serve_util.py (a real server on 127.0.0.1) and tests/parallel/test_tensor_parallel.py's rank runner are
# imported by engine, api, formats and models tests too: importable whichever folder a run starts from
sys.path.insert(0, str(Path(__file__).parent / "serve"))
sys.path.insert(0, str(Path(__file__).parent / "parallel"))

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"

import pytest  # noqa: E402

if INTERPRETER:
    # @triton.jit reads TRITON_INTERPRET when a kernel module is imported, not when it runs: import every
    # kernel module now, so that a test which deletes TRITON_INTERPRET (to measure the CPU backend) and is the
    # first to import one does not leave real-GPU kernels behind for the tests after it.
    import importlib  # noqa: E402
    import pkgutil  # noqa: E402

    import tritonq.kernels  # noqa: E402
    for _module in pkgutil.walk_packages(tritonq.kernels.__path__, "tritonq.kernels."):
        importlib.import_module(_module.name)

# test_int4_kernel_compiles_within_shared_memory, test_moe_gemm_kernel_aot_compiles, ...
AOT_NAME = re.compile(r"(^|_)(aot|compiles?)(_|$)")


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (kernels run natively there); none here")
    native = pytest.mark.skip(reason="checks Triton's interpreter path; kernels run natively on this CUDA machine "
                                     "(TRITON_INTERPRET=1 runs it here)")
    for item in items:
        if AOT_NAME.search(getattr(item, "originalname", item.name)):
            item.add_marker(pytest.mark.aot)
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(no_gpu)
        if "interpreter" in item.keywords and not INTERPRETER:
            item.add_marker(native)


@pytest.fixture(scope="session", autouse=True)
def _fp32_cpu_default():
    """load() without dtype= computes in fp32 on CPU in every test, whatever the CPU: bf16 is the default only
    where the CPU has native bf16 (tritonq.api.load.cpu_has_native_bf16), and the tests compare against fp32
    references with fp32 tolerances. Tests of that choice patch it themselves; subprocesses pass dtype."""
    from tritonq.api import load as loading
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "cpu_has_native_bf16", lambda: False)
        yield


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """Where kernel tests put their tensors: the GPU when there is one, else the CPU (interpreter); `meta`
    under the fake-GPU plugin (tests/fake_gpu.py)."""
    fake_gpu = request.config.pluginmanager.get_plugin("fake_gpu")
    if fake_gpu is not None:
        return fake_gpu.DEVICE
    return torch.device("cuda" if CUDA and not INTERPRETER else "cpu")


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


@pytest.fixture(scope="module")
def tiny_llama_model(tmp_path_factory):
    """A tiny Llama (hidden 32, 1 layer, byte tokenizer) on the torch reference backend, one per test module
    (tests change its EOS ids): max_num_seqs=3, max_seq_len=32."""
    import tritonq
    from tritonq.demo import write_tiny_llama
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        yield tritonq.load(folder, max_num_seqs=3, max_seq_len=32)
