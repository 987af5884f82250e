"""Load speed: tritonq loading (+ AWQ -> internal repack) vs plainly reading every tensor.

    python -m tritonq.bench load [--gb 1.0] [--device cpu|cuda] [--json PATH]

Writes a synthetic AWQ checkpoint (Llama-7B-shaped layers, random codes, two shards + index) to a
temp dir, then times, in the same run: (a) safetensors.safe_open reading every tensor, (b) tritonq's
get_loader + get_linear for every quantized linear. Twice: from a warm page cache (a reload: the
raw read is then a memcpy) and from a cold one (the files evicted with posix_fadvise before each
run: a first load, where the disk read is part of both).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tritonq.bench.common import print_table, write_json
from tritonq.formats.registry import get_loader

HIDDEN, INTERMEDIATE, GROUP = 4096, 11008, 128
MODULES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
           "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
           "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
           "mlp.down_proj": (HIDDEN, INTERMEDIATE)}


def write_synthetic_awq(folder: Path, gb: float) -> list[str]:
    """AWQ GEMM tensors for as many layers as fit in `gb`; returns the linear prefixes."""
    per_layer = sum(N * K // 2 + (K // GROUP) * N * 2.5 for N, K in MODULES.values())
    layers = max(1, round(gb * 2**30 / per_layer))
    prefixes, weight_map = [], {}
    for shard, span in enumerate((range(0, layers // 2), range(layers // 2, layers))):
        tensors = {}
        for i in span:
            for m, (N, K) in MODULES.items():
                p = f"model.layers.{i}.{m}"
                prefixes.append(p)
                tensors[f"{p}.qweight"] = torch.randint(-2**31, 2**31 - 1, (K, N // 8), dtype=torch.int32)
                tensors[f"{p}.qzeros"] = torch.randint(-2**31, 2**31 - 1, (K // GROUP, N // 8), dtype=torch.int32)
                tensors[f"{p}.scales"] = torch.rand(K // GROUP, N, dtype=torch.float16)
        name = f"model-{shard + 1:05d}-of-00002.safetensors"
        if tensors:
            save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= {k: name for k in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}}))
    return prefixes


def read_raw(folder: Path, device: str) -> int:
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device=device) as h:
            for k in h.keys():
                total += h.get_tensor(k).clone().numel()  # clone: touch every byte, as a load does
    return total


def load_tritonq(folder: Path, prefixes: list[str], device: str) -> int:
    loader = get_loader(folder, torch.float16, device)
    return sum(loader.get_linear(p).qweight.numel() for p in prefixes)


def evict(folder: Path) -> None:
    """Drop the checkpoint's pages from the OS page cache (Linux; the files are clean, so this is safe)."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def best_of(fn, repeats: int, device: str, cold: bool = False, folder: Path | None = None) -> float:
    times = []
    for _ in range(repeats):
        if cold:
            evict(folder)
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tritonq.bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the results here")
    a = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prefixes = write_synthetic_awq(folder, a.gb)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**30
        os.sync()  # written pages must be clean before they can be evicted
        rows = []
        for cache in ("warm", "cold") if hasattr(os, "posix_fadvise") else ("warm",):
            cold = cache == "cold"
            raw = best_of(lambda: read_raw(folder, a.device), a.repeats, a.device, cold, folder)
            ours = best_of(lambda: load_tritonq(folder, prefixes, a.device), a.repeats, a.device, cold, folder)
            rows.append({"page_cache": cache, "checkpoint_GiB": size, "linears": len(prefixes), "device": a.device,
                         "safe_open_s": raw, "tritonq_s": ours, "ratio": ours / raw, "tritonq_GiB_per_s": size / ours})
    print_table(rows)
    if a.json:
        write_json(a.json, "load", rows, command=f"python -m tritonq.bench load {' '.join(argv or [])}")
