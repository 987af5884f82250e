"""Kernel families. Each file holds the @triton.jit kernel, its launcher and a torch reference.

Backend choice (one place, `backend(x)`): CUDA tensors run the Triton kernels; CPU tensors run the CPU backend
(kernels/cpu/: torch's CPU kernels over weights prepared once, and a small C library), except under
TRITON_INTERPRET=1, where the Triton kernel itself runs on CPU (that is how the tests exercise it).
TRITONQ_BACKEND=torch forces the plain torch references (float32 compute, the test oracle); =triton forces Triton.
Pieces the kernel families share (jit helpers, launch configs, `Launch`) are in common.py.

Batch-invariant mode (`batch_invariant()`, on inside `batch_invariant_mode()`; tritonq.load(batch_invariant=True)
runs the model's forward in it): every kernel computes a row with one reduction order whatever the other rows of the
call (docs/batch_invariance.md). Outside it, kernels pick paths, tiles and splits by the row count, so bf16 / fp16
results can change with what shares the batch.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar

import torch


# The two settings every kernel call reads (a step makes ~10 calls a layer): looked up in os.environ's own dict under
# their encoded names, which is what os.environ.get does after encoding the name and before decoding the value (~1 us
# a call together, measurable on a small model's decode step). os.environ's setters and monkeypatch keep that dict
# current, so a change made while running is seen by the next call.
_ENVIRON = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
if _ENVIRON is None or _ENCODE is None:  # not CPython's os._Environ: ask os.environ itself
    def _setting(key: str) -> str | None:
        return os.environ.get(key)
else:
    _KEYS = {key: _ENCODE(key) for key in ("TRITONQ_BACKEND", "TRITON_INTERPRET")}
    _decode = os.environ.decodevalue

    def _setting(key: str) -> str | None:
        value = _ENVIRON.get(_KEYS[key])
        return None if value is None else _decode(value)


def backend(x: torch.Tensor) -> str:
    """The backend an op on x's device runs, decided here only: "triton" (CUDA tensors; any under
    TRITON_INTERPRET=1 or TRITONQ_BACKEND=triton), "cpu" (CPU tensors: kernels/cpu/, torch's CPU kernels and the C
    library) or "torch" (the float32 references: TRITONQ_BACKEND=torch, or a device neither runs, such as meta)."""
    forced = _setting("TRITONQ_BACKEND")
    if forced == "torch":
        return "torch"
    if forced == "triton" or x.is_cuda or _setting("TRITON_INTERPRET") == "1":
        return "triton"
    return "cpu" if x.is_cpu else "torch"  # (flags: x.device builds an object)


@contextmanager
def threads_for(work: int, parallel_work: int):
    """One intra-op thread inside the block when work (the caller's count of its largest op) is below
    parallel_work, the caller's threads otherwise; the thread count comes back afterwards. Each small op is
    one OpenMP parallel region that waits for every thread: on a shared machine a descheduled worker stalls
    it, and even on a quiet one waking threads for a tiny tensor costs more than the op."""
    threads = torch.get_num_threads()
    if work >= parallel_work or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


_BATCH_INVARIANT = ContextVar("tritonq_batch_invariant", default=False)


def batch_invariant() -> bool:
    """True inside batch_invariant_mode(): kernels then choose their paths and launch configs independently of the
    number of rows (docs/batch_invariance.md). Always False in a step torch.compile traces: the mode is refused
    with compile=True, and dynamo cannot trace a ContextVar."""
    return not torch.compiler.is_compiling() and _BATCH_INVARIANT.get()


@contextmanager
def batch_invariant_mode(on: bool = True):
    """batch_invariant() is `on` inside the block (this thread and context only), as before afterwards."""
    token = _BATCH_INVARIANT.set(on)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)
