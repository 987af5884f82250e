"""Kernel families. Each file holds the @triton.jit kernel, its launcher and a torch reference.

Backend choice (one place): CUDA tensors run the Triton kernels; CPU tensors run the torch
reference (float32 compute), except under TRITON_INTERPRET=1, where the Triton kernel itself
runs on CPU (that is how the tests exercise it). TRITONQ_BACKEND=torch|triton overrides.
"""
from __future__ import annotations

import os

import torch


def use_triton(x: torch.Tensor) -> bool:
    """True if the Triton kernel should run for a tensor on x's device."""
    forced = os.environ.get("TRITONQ_BACKEND", "auto")
    if forced == "torch":
        return False
    if forced == "triton" or x.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"
