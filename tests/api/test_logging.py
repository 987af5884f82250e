"""What a load says (tritonq's log) and how progress shows (tritonq/progress.py): each fact once, at INFO,
warnings only for what needs action, on stderr even when the application configured no logging; bars
that end at 100% and stay."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import tritonq
from tritonq.demo import DEFAULT_MODEL
from tritonq.kernels.cpu import lowbit as cpu_lowbit
from tritonq.progress import progress_bar

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a thread pool only adds sync overhead
# Loads as a user's: on the CPU backend (its notes are what is checked), not through Triton's interpreter
# (tests/conftest.py sets TRITON_INTERPRET=1 for the kernel tests).
NO_INTERPRETER = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def load_records(caplog, **options) -> list[logging.LogRecord]:
    """The tritonq log records of one load of the default model (the CPU-backend notes said afresh)."""
    cpu_lowbit._note.cache_clear()  # once per process: forget earlier tests' loads
    with caplog.at_level(logging.DEBUG, logger="tritonq"):
        tritonq.load(DEFAULT_MODEL, dtype="float32", **options)
    return [r for r in caplog.records if r.name.startswith("tritonq")]


@pytest.mark.parametrize("quantize, note", [(None, None), ("int4", "4-bit weights run torch's CPU int4 kernel"),
                                            ("fp8", "FP8 (no CPU fp8 GEMM")])
def test_load_says_each_fact_once_at_info_and_warns_of_nothing(quantize, note, caplog):
    """A healthy load warns of nothing; the KV-cache size shows at INFO; each message is said once (the FP8
    note was said per layer shape: four times on the default model, as warnings)."""
    records = load_records(caplog, quantize=quantize)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    said = Counter(r.getMessage() for r in records)
    assert max(said.values()) == 1, said
    kv = [r for r in records if r.getMessage().startswith("KV cache: ")]
    assert len(kv) == 1 and kv[0].levelno == logging.INFO
    assert "sequences of max_seq_len=512 at once" in kv[0].getMessage()
    notes = [r for r in records if r.getMessage().startswith("CPU backend: ")]
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and note in notes[0].getMessage() and notes[0].levelno == logging.INFO


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**NO_INTERPRETER, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env})


LOAD = f"import tritonq; tritonq.load({str(DEFAULT_MODEL)!r}, dtype='float32', quantize='fp8')"


def test_info_lines_print_on_stderr_without_logging_configured():
    """No logging.basicConfig: the facts still reach stderr, each once; an application's own logging
    configuration replaces tritonq's handler (nothing twice); TRITONQ_LOG_LEVEL quiets it."""
    err = run_python(LOAD).stderr
    lines = [line for line in err.splitlines() if " tritonq" in line and ("INFO" in line or "WARNING" in line)]
    assert sum("KV cache: " in line for line in lines) == 1, err
    assert sum("CPU backend: FP8" in line for line in lines) == 1, err
    assert all(line.startswith("INFO ") for line in lines), err
    configured = run_python("import logging; logging.basicConfig(level=logging.INFO, format='ROOT %(message)s'); "
                            + LOAD).stderr
    assert configured.count("KV cache: ") == 1 and "ROOT KV cache: " in configured, configured
    assert "KV cache: " not in run_python(LOAD, TRITONQ_LOG_LEVEL="WARNING").stderr


def test_progress_bar_ends_at_100_percent_and_stays(capsys):
    with progress_bar(total=5, desc="Working", unit="item") as bar:
        for _ in range(5):
            bar.update(1)
    err = capsys.readouterr().err
    last = err.rstrip("\n").split("\r")[-1]
    assert last.startswith("Working: 100%") and "5/5" in last and err.endswith("\n"), repr(err)
    with progress_bar(total=5, desc="Silent", unit="item", enabled=False) as bar:
        bar.update(5)
    assert capsys.readouterr().err == ""


def test_loading_bar_reaches_100_percent(capsys):
    tritonq.load(DEFAULT_MODEL, dtype="float32")
    err = capsys.readouterr().err
    loading = [part for part in err.replace("\n", "\r").split("\r") if part.startswith("Loading checkpoint")]
    assert loading and loading[-1].startswith("Loading checkpoint: 100%"), repr(err)
