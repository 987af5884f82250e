"""Shared benchmark helpers: timing, device peak figures, table and JSON output."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

# (HBM GB/s, dense fp16/bf16 TFLOP/s, dense fp8 TFLOP/s or None) from vendor spec sheets.
DEVICE_PEAKS = {
    "H200": (4800, 989, 1979),
    "H100": (3350, 989, 1979),
    "A100": (2039, 312, None),
    "L4": (300, 121, 242),
    "T4": (320, 65, None),
}
FALLBACK_PEAK = (1000, 100, None)


def device_peaks() -> tuple[str, tuple]:
    """(device name, (GB/s, TFLOP/s fp16, TFLOP/s fp8)) for the current device; fallback if unknown."""
    if not torch.cuda.is_available():
        return "cpu", FALLBACK_PEAK
    name = torch.cuda.get_device_name()
    for key, peaks in DEVICE_PEAKS.items():
        if key in name:
            return name, peaks
    return name, FALLBACK_PEAK


def time_ms(fn, warmup: int = 3, rep: int = 10) -> float:
    """Median milliseconds per call: triton.testing.do_bench on CUDA, perf_counter on CPU."""
    if torch.cuda.is_available():
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))


def write_json(path: str | Path, name: str, rows: list[dict], **meta) -> None:
    device, _ = device_peaks()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"benchmark": name, "device": device, **meta, "rows": rows}, indent=1))
    print(f"wrote {path}")
