"""Kernel families. Each file holds the @triton.jit kernel, its launcher and a torch reference.

Backend choice (one place): CUDA tensors run the Triton kernels; CPU tensors run torch's CPU
kernels over weights prepared once (`cpu_lowbit`) and paged attention through torch's CPU flash
kernel over each sequence's real keys (`cpu_attention`), except under TRITON_INTERPRET=1, where the
Triton kernel itself runs on CPU (that is how the tests exercise it). TRITONQ_BACKEND=torch
forces the plain torch references (float32 compute, the test oracle); =triton forces Triton.
Pieces the kernel families share (jit helpers, launch configs, `Launch`) are in common.py.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch


def use_triton(x: torch.Tensor) -> bool:
    """True if the Triton kernel should run for a tensor on x's device."""
    forced = os.environ.get("TRITONQ_BACKEND", "auto")
    if forced == "torch":
        return False
    if forced == "triton" or x.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """True if a tensor on x's device should run the CPU backend (kernels/cpu_lowbit.py, cpu_attention.py)."""
    if x.device.type != "cpu":
        return False
    forced = os.environ.get("TRITONQ_BACKEND", "auto")  # not use_triton(x) and not forced to torch, read once
    return forced not in ("torch", "triton") and os.environ.get("TRITON_INTERPRET") != "1"


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
