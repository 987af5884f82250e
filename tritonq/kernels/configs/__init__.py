"""Tuned launch configs stored as data: configs/<kernel>/<gpu-name>.json, written by `tritonq.tune`.

File format: {"<shape bucket>": {"BLOCK_M": 16, ..., "num_warps": 4, "num_stages": 3}, ...}.
Bucket keys are chosen by each kernel (e.g. "M16_N4096_K4096"). Unknown GPU or shape -> None,
and the kernel uses its defaults in code. Files are read once per process.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

CONFIG_DIR = Path(__file__).parent


def gpu_name() -> str:
    """File-name form of the current CUDA device name ("NVIDIA H200" -> "nvidia_h200"), or "cpu"."""
    import torch
    if not torch.cuda.is_available():
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name().lower()).strip("_")


@functools.cache
def load_configs(kernel: str, gpu: str | None = None) -> dict:
    path = CONFIG_DIR / kernel / f"{gpu or gpu_name()}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def lookup(kernel: str, bucket: str) -> dict | None:
    """The tuned config for `bucket` on this GPU, or None."""
    return load_configs(kernel).get(bucket)
