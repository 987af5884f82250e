"""Shared benchmark helpers: timing, device peak figures, table and JSON output."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from tritonq.workbench import model_gemm_shapes, parse_shapes, print_table  # noqa: F401  (bench's modules use them from here)

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


def machine_label() -> str:
    """The machine a result was measured on, in words (a stored notebook output says where it came from):
    the GPU, or the CPU model, its logical cores, native bf16 and the load average; torch's version."""
    if torch.cuda.is_available():
        where = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    else:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                     "unknown CPU")
        load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
        bf16 = ", AVX512-BF16" if "avx512_bf16" in cpuinfo else ""
        where = f"{model} ({os.cpu_count()} logical cores{bf16}{load}), no GPU"
    return f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def backend_label(device: str) -> str:
    """What a benchmark on `device` times: Triton on a GPU; on CPU the interpreter, the CPU backend
    (kernels/cpu/) or the torch reference (TRITONQ_BACKEND=torch)."""
    from tritonq.kernels import backend
    chosen = backend(torch.empty(0, device=device))
    if chosen == "cpu":
        return "torch CPU kernels"
    if chosen == "torch":
        return "torch reference"
    return "triton" if device == "cuda" else "triton interpreter"


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


def results_path(name: str) -> str | None:
    """Default --json path: bench/results/<name> of the tritonq source checkout when it runs from inside
    that checkout (the package imported from it); elsewhere None: print only, --json PATH writes."""
    repo = Path(__file__).resolve().parents[2]
    inside = Path.cwd().resolve().is_relative_to(repo)
    if inside and (repo / "pyproject.toml").is_file() and (repo / "bench").is_dir():
        return str(repo / "bench" / "results" / name)
    return None


def write_json(path: str | Path, name: str, rows: list[dict], **meta) -> None:
    device, _ = device_peaks()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"benchmark": name, "device": device, **meta, "rows": rows}, indent=1))
    print(f"wrote {path}")


# ---- GEMM benchmarks (shared by int4_gemm.py and fp8.py) ------------------------------------

GEMM_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
CPU_GEMM_M = (1, 4, 16, 64)  # CPU runs the torch references: small shapes only

# Public configs of the two reference models (only the fields GEMM shapes depend on).
LLAMA_2_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
              "num_attention_heads": 32, "num_key_value_heads": 32}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
                    "num_attention_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                    "moe_intermediate_size": 1408}
MODELS = {"llama-2-7b": LLAMA_2_7B, "deepseek-v2-lite": DEEPSEEK_V2_LITE}


def gemm_row(label: str, M: int, N: int, K: int, ours_ms: float, baseline_ms: float,
             bytes_moved: int, fp8: bool = False) -> dict:
    """One result row: time, achieved GB/s and TFLOP/s, % of the device roofline, speedup.

    label names the weight (e.g. "llama-2-7b.o_proj"); rows with one label form one plot line.
    bytes_moved: weight bytes as stored + activations in + output out.
    roofline_pct: the roofline time max(bytes / peak BW, flops / peak compute) over the measured time.
    """
    _, (peak_gbs, peak_tflops, peak_fp8) = device_peaks()
    peak = peak_fp8 if fp8 and peak_fp8 else peak_tflops
    flops = 2 * M * N * K
    gbs = bytes_moved / ours_ms / 1e6
    tflops = flops / ours_ms / 1e9
    roofline_ms = max(bytes_moved / peak_gbs / 1e6, flops / peak / 1e9)
    return {"shape": label, "M": M, "N": N, "K": K, "ms": ours_ms, "baseline_ms": baseline_ms,
            "speedup": baseline_ms / ours_ms, "GB/s": gbs, "TFLOP/s": tflops,
            "bw_pct": 100 * gbs / peak_gbs, "roofline_pct": 100 * roofline_ms / ours_ms}


def time_gemm(label: str, ms, dense: torch.Tensor, run, weight_bytes: int, backend: str, fp8: bool = False):
    """For each M in ms: (x, its `gemm_row` with `backend` named), x random [M, K] in dense's dtype and
    device, run(x) (the quantized GEMM) timed against x @ dense.T, dense [N, K] the same weight dequantized."""
    N, K = dense.shape
    for M in ms:
        x = torch.randn(M, K, dtype=dense.dtype, device=dense.device)
        ours = time_ms(lambda: run(x))
        base = time_ms(lambda: x @ dense.T)
        moved = weight_bytes + x.numel() * x.element_size() + M * N * x.element_size()
        yield x, gemm_row(label, M, N, K, ours, base, moved, fp8=fp8) | {"backend": backend}


def plot_gemm(json_path: str | Path, png_path: str | Path) -> None:
    """Speedup over the baseline and % of roofline against M, one line per weight shape, from a bench JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(json_path).read_text())
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list[dict]] = {}
    for row in data["rows"]:
        series.setdefault(row["shape"], []).append(row)
    for label, rows in series.items():
        rows.sort(key=lambda r: r["M"])
        ms = [r["M"] for r in rows]
        axes[0].plot(ms, [r["speedup"] for r in rows], marker="o", label=label)
        axes[1].plot(ms, [r["roofline_pct"] for r in rows], marker="o", label=label)
    for ax, title in zip(axes, (f"speedup over {data.get('baseline', 'baseline')}", "% of roofline")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{data['benchmark']} on {data['device']} ({data.get('backend', '')})")
    fig.tight_layout()
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    print(f"wrote {png_path}")


def add_size_args(parser, full: dict[str, int], quick: dict[str, int], quick_help: str) -> None:
    """--quick and one int option per workload size in full (default None: `fill_sizes` puts in full's value, or
    quick's with --quick, so an explicit value wins either way)."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    for name, default in full.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"default {default} (--quick: {quick[name]})")


def fill_sizes(args, full: dict[str, int], quick: dict[str, int]) -> None:
    """The sizes left unset on the command line (see add_size_args): quick's with --quick, else full's."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def add_output_args(p, name: str) -> None:
    """--json (default: the checkout's bench/results/<name>.json when run inside it) and --plot."""
    p.add_argument("--json", default=results_path(f"{name}.json"),
                   help=f"write the rows here (default: the checkout's bench/results/{name}.json when run inside it)")
    p.add_argument("--plot", default=None, help="also write a PNG plot here (needs --json)")


def parse_output_args(p, argv: list[str]):
    """p.parse_args(argv), refusing --plot without --json before any work is done."""
    args = p.parse_args(argv)
    if args.plot and not args.json:
        p.error("--plot draws from the JSON results: pass --json PATH too")
    return args


def report_gemm(name: str, rows: list[dict], baseline: str, dtype, args, argv: list[str]) -> None:
    """Print a GEMM benchmark's table, write its JSON (args.json) with the command that made it, plot it (args.plot)."""
    backend = rows[0]["backend"] if rows else ""
    print(f"{name} vs {baseline}; backend: {backend or '-'}")
    print_table(rows)
    if args.json:
        write_json(args.json, name, rows, baseline=baseline, dtype=str(dtype), backend=backend,
                   command=f"python -m tritonq.bench {name} {' '.join(argv)}")
    if args.plot:
        plot_gemm(args.json, args.plot)
