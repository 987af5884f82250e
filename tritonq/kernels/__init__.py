"""Kernel families. Each file holds the @triton.jit kernel, its launcher and a torch reference.

Backend choice (one place): CUDA tensors run the Triton kernels; CPU tensors run torch's CPU
kernels over weights prepared once (`cpu_lowbit`), except under TRITON_INTERPRET=1, where the
Triton kernel itself runs on CPU (that is how the tests exercise it). TRITONQ_BACKEND=torch
forces the plain torch references (float32 compute, the test oracle); =triton forces Triton.
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


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """True if a tensor on x's device should run the CPU backend (kernels/cpu_lowbit.py)."""
    return (x.device.type == "cpu" and not use_triton(x)
            and os.environ.get("TRITONQ_BACKEND", "auto") != "torch")


def check_launch_config(kernel: str, config, blocks: tuple[str, ...]) -> None:
    """ValueError unless config's `blocks` fields are powers of two >= 16 (tl.dot's smallest tile),
    num_warps a power of two <= 32 and num_stages an int >= 1. kernel names the caller in the message."""
    def pow2(n) -> bool:
        return isinstance(n, int) and n > 0 and n & (n - 1) == 0
    for name in blocks:
        value = getattr(config, name)
        if not pow2(value) or value < 16:
            raise ValueError(f"{kernel}: config.{name} = {value!r}, expected a power of two >= 16 "
                             "(tl.dot's smallest tile), e.g. 64")
    if not pow2(config.num_warps) or config.num_warps > 32:
        raise ValueError(f"{kernel}: config.num_warps = {config.num_warps!r}, expected a power of two in [1, 32]")
    if not isinstance(config.num_stages, int) or config.num_stages < 1:
        raise ValueError(f"{kernel}: config.num_stages = {config.num_stages!r}, expected an int >= 1")
