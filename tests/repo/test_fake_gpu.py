"""The kernel tests pass with a non-CPU test device (tests/fake_gpu.py: `meta`, generators and Triton
launches made to behave as on CUDA), so a CPU-only assumption in a test shows here, not on the first GPU.

The AOT compile tests are left out (they run in their own child processes, on no device); so are the
`interpreter` tests, which a GPU skips too.
"""
import json
import tempfile
from pathlib import Path

from child_process import Child

ROOT = Path(__file__).resolve().parents[2]

# Every kernel family's launch must be reached: a test that stops (at a meta-only data access) before its
# kernel checks nothing about the device, so losing a whole family here means the run lost its point.
KERNELS = {"_decode_merge_kernel", "_decode_split_kernel", "_fp8_gemm_kernel", "_int4_gemm_kernel",
           "_moe_align_kernel", "_moe_gemm_kernel", "_paged_prefill_kernel", "_quantize_activation_kernel",
           "_rms_norm_kernel", "_silu_mul_kernel", "_write_slots_kernel"}

# The CPU backend's tests (marked cpu_backend: tests/kernels/cpu/, test_backends_agree.py) keep their tensors on
# the CPU by design, so on a fake GPU they would rerun the CI run's own cases unchanged: left out by marker; every
# other kernel test keeps this guard.


_FOLDER = tempfile.TemporaryDirectory(prefix="fake_gpu")  # the run's JSON report (removed at exit)
_CHILD = Child(["-m", "pytest", "tests/kernels", "-p", "fake_gpu", "-p", "no:cacheprovider",
                "-m", "kernels and not interpreter and not cpu_backend", "-k", "not compile", "-q", "-rf", "--tb=short",
                f"--fake-gpu-report={Path(_FOLDER.name) / 'fake_gpu.json'}"], cwd=ROOT)


def background_children(items) -> list[Child]:
    """The fake-GPU run, run niced by tests/conftest.py once the session is collected (this test runs last)."""
    return [_CHILD]


def test_kernel_tests_pass_on_a_fake_gpu():
    try:
        _CHILD.stdout(timeout=900)
    except AssertionError as error:
        raise AssertionError(f"the kernel tests fail on a fake GPU:\n{error}") from None
    report = Path(_FOLDER.name) / "fake_gpu.json"
    result = json.loads(report.read_text())
    outcomes = list(result["outcomes"].values())
    # the run really ran the kernel tests (128 pass on meta; the others stop at a meta-only data access after their
    # launches, which KERNELS below counts)
    assert outcomes.count("passed") > 100, outcomes
    assert set(result["kernels"]) >= KERNELS, f"kernels never launched: {KERNELS - set(result['kernels'])}"
