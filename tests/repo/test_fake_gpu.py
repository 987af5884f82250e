"""The kernel tests pass with a non-CPU test device (tests/fake_gpu.py: `meta`, generators and Triton
launches made to behave as on CUDA), so a CPU-only assumption in a test shows here, not on the first GPU.

The AOT compile tests are left out (they run in their own child processes, on no device); so are the
`interpreter` tests, which a GPU skips too.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Every kernel family's launch must be reached: a test that stops (at a meta-only data access) before its
# kernel checks nothing about the device, so losing a whole family here means the run lost its point.
KERNELS = {"_decode_merge_kernel", "_decode_split_kernel", "_fp8_gemm_kernel", "_int4_gemm_kernel",
           "_moe_align_kernel", "_moe_gemm_kernel", "_paged_prefill_kernel", "_quantize_activation_kernel",
           "_rms_norm_kernel", "_route_kernel", "_silu_mul_kernel", "_write_slots_kernel"}

# The CPU backend's tests (marked cpu_backend: tests/kernels/cpu/, test_backends_agree.py) keep their tensors on
# the CPU by design, so on a fake GPU they would rerun the CI run's own cases unchanged: left out by marker; every
# other kernel test keeps this guard.


def test_kernel_tests_pass_on_a_fake_gpu(tmp_path):
    report = tmp_path / "fake_gpu.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests"), str(ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/kernels", "-p", "fake_gpu", "-p", "no:cacheprovider",
                           "-m", "kernels and not interpreter and not cpu_backend", "-k", "not compile", "-q", "-rf",
                           "--tb=short",
                           f"--fake-gpu-report={report}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"the kernel tests fail on a fake GPU:\n{done.stdout[-6000:]}{done.stderr[-2000:]}"
    result = json.loads(report.read_text())
    outcomes = list(result["outcomes"].values())
    # the run really ran the kernel tests (128 pass on meta; the others stop at a meta-only data access after their
    # launches, which KERNELS below counts)
    assert outcomes.count("passed") > 100, outcomes
    assert set(result["kernels"]) >= KERNELS, f"kernels never launched: {KERNELS - set(result['kernels'])}"
