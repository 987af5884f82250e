"""Loading holds each tensor once: peak resident memory while loading stays under 1.3x the bytes
the loaded model keeps plus its largest single tensor (a transient copy of one tensor at a time),
for dense fp32, fp16 loaded as fp32, AWQ, GPTQ and FP8 checkpoints. Measured in a fresh child
process per load (peak RSS is per process), by tritonq.bench.memory. Dense fp32 (also from fp16)
holds nothing twice: its peak is the model plus one read buffer.
"""
import pytest

from tritonq.bench.memory import TARGET_FACTOR, measure, warmup_for, write_checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    return root, write_checkpoints(root, layers=4, hidden=512)


@pytest.mark.parametrize("kind", ["dense fp32", "fp16->fp32", "awq", "gptq", "fp8"])
def test_load_peak_memory_is_held_bytes_plus_one_tensor(checkpoints, kind):
    root, made = checkpoints
    folder, options = made[kind]
    row = measure(folder, warmup_for(root, kind), options)
    assert row["held_MiB"] > 30  # big enough that the process's own noise (a few MiB) does not decide
    assert row["peak_MiB"] <= TARGET_FACTOR * row["held_MiB"] + row["largest_MiB"], row
    if kind.startswith("dense") or kind == "fp16->fp32":
        # Dense weights are read straight into their final fp32 [K, N] storage (formats/base.py): nothing is
        # held twice, the peak is the model plus the 4 MiB read buffer (and a few MiB of process noise).
        assert row["peak_MiB"] <= row["held_MiB"] + 8, row
