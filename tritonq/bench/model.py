"""Predicted fraction of HBM bandwidth of the decode linears, from their SASS: `python -m tritonq.bench model`.

No GPU: each weight type's launch (the launcher's own builder over meta tensors, default config) is compiled
ahead of time for sm_90 (kernels/aot.py) and its main loop read (`aot.loop_mix`). Two bounds, per layer:

  issue    an SM issues 4 warp instructions (128 thread instructions) per clock; at full bandwidth it must
           consume bandwidth / (SMs x clock x bytes per weight) weights per clock, each costing the loop's
           instructions per weight: issue = min(1, 128 / (weights per clock x instructions per weight));
  latency  Little's law: an SM keeps bandwidth x latency / SMs bytes in flight at full bandwidth; a program
           has one weight tile per pipeline stage ahead (num_stages - 1, at least 1) in flight, and an SM
           holds min(occupancy, programs / SMs) programs: latency = min(1, in flight / needed).

predicted = min(issue, latency). Left out: launch and split-K reduction time, DRAM efficiency below the
spec-sheet bandwidth, L2 effects, tail waves. The memory latency is an assumption (`--latency-ns`), not a
measurement. docs/gpu_kernels.md explains the model and the dequantization it measures.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonq.bench.common import LLAMA_2_7B, model_gemm_shapes, print_table


@dataclass(frozen=True)
class Gpu:
    sms: int
    clock_ghz: float  # boost clock
    bandwidth_gbs: float  # HBM, spec sheet
    registers: int = 65536  # per SM
    shared_bytes: int = 233472  # per SM (228 KB)
    threads: int = 2048  # per SM
    programs: int = 32  # resident per SM


# Spec sheets: H100 SXM5 (HBM3) and H200 SXM (HBM3e), both sm_90 with 132 SMs at 1.98 GHz boost.
GPUS = {"H100": Gpu(132, 1.98, 3350), "H200": Gpu(132, 1.98, 4800)}
CC = 90
ISSUE_PER_CLOCK = 128  # thread instructions per SM per clock: 4 schedulers x 1 warp instruction x 32 threads
MODELS = {  # the config.json fields model_gemm_shapes reads
    "Llama-2-7B": LLAMA_2_7B,
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128),
}
WEIGHT_TYPES = ("int4-awq", "int4-gptq", "int4-act-order", "int8-gptq", "nf4", "fp8-block", "w8a8")


def weight_launch(kind: str, M: int, N: int, K: int, cc: int = CC, dtype: torch.dtype = torch.bfloat16):
    """The runtime's launch on sm_`cc` (default config, meta tensors) of an N x K linear of weight type `kind`
    at M rows (fp8-block: fp8 x fp8 from sm_89, weight-only below)."""
    from tritonq.kernels import fp8_gemm, int4_gemm, int8_gemm

    if kind.startswith(("int4", "int8", "nf4")):
        options = {"int4-awq": {}, "int4-gptq": dict(zeros=False), "int4-act-order": dict(zeros=False, act_order=True),
                   "int8-gptq": dict(bits=8, zeros=False), "nf4": dict(code=True)}[kind]
        config = int4_gemm.default_config(M, N, K, cc=cc)  # act-order: sorted by group, the plain GPTQ tile
        return int4_gemm.aot_launch(config, M, N, K, dtype, cc=cc, **options)
    if kind == "fp8-block":
        config = fp8_gemm.default_config(M, N, K, cc=cc, block_scaled=True, weight_only=cc < 89)
        return fp8_gemm.aot_launch(config, M, N, K, cc, dtype)
    if kind == "w8a8":
        return int8_gemm.aot_launch(int8_gemm.default_config(M, N, K, cc), M, N, K, cc, dtype)
    raise ValueError(f"weight_launch: unknown weight type {kind!r}; choose from {', '.join(WEIGHT_TYPES)}")


def launch_bytes(launch) -> int:
    """Bytes of every distinct tensor the launch reads or writes (weights, scales, activations, output)."""
    tensors = {id(v): v for v in launch.args.values() if isinstance(v, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def weights_per_iteration(launch) -> int:
    """Weights one program streams per main-loop iteration: a BLOCK_K x BLOCK_N tile."""
    return launch.args["BLOCK_K"] * launch.args["BLOCK_N"]


def occupancy(mix, launch, gpu: Gpu) -> int:
    """Programs resident per SM, from registers (allocated per warp in multiples of 8 per thread), shared
    memory (1 KB reserved per program), threads and the per-SM program limit."""
    threads = 32 * launch.num_warps
    registers = -(-(mix.registers or 255) // 8) * 8
    return max(1, min(gpu.registers // (registers * threads), gpu.shared_bytes // (mix.shared_bytes + 1024),
                      gpu.threads // threads, gpu.programs))


def predict(mix, launch, N: int, K: int, gpu: Gpu, latency_ns: float) -> dict:
    """The issue and latency bounds of one launch (see the module docstring) and their minimum."""
    bytes_per_weight = launch_bytes(launch) / (N * K)
    per_iteration = weights_per_iteration(launch)
    per_thread = per_iteration / (32 * launch.num_warps)
    instructions = mix.total / per_thread
    weights_per_clock = gpu.bandwidth_gbs / (gpu.sms * gpu.clock_ghz * bytes_per_weight)
    issue = min(1.0, ISSUE_PER_CLOCK / (weights_per_clock * instructions))
    programs = 1
    for g in launch.grid:
        programs *= g
    resident = min(occupancy(mix, launch, gpu), programs / gpu.sms)
    in_flight = resident * per_iteration * bytes_per_weight * max(1, launch.num_stages - 1)
    needed = gpu.bandwidth_gbs * latency_ns / gpu.sms  # GB/s x ns = bytes
    latency = min(1.0, in_flight / needed)
    return dict(instr_per_weight=instructions, alu_per_weight=mix.alu / per_thread, issue=issue,
                kb_in_flight=in_flight / 1024, latency=latency, predicted=min(issue, latency))


def rows(gpus: list[str], kinds: list[str], M: int, latency_ns: float) -> list[dict]:
    """One row per (GPU, model, layer, weight type), and per (GPU, model, weight type) the whole decoder
    block's figure: the byte-weighted harmonic mean of its layers' fractions (time adds up)."""
    from tritonq.kernels.aot import loop_mix

    mixes: dict = {}
    out = []
    for gpu_name in gpus:
        gpu = GPUS[gpu_name]
        for model, config in MODELS.items():
            for kind in kinds:
                total_bytes = total_time = 0.0
                for layer, N, K in model_gemm_shapes(config):
                    launch = weight_launch(kind, M, N, K)
                    key = (kind, tuple(sorted((k, v) for k, v in launch.args.items() if not isinstance(v, torch.Tensor)
                                              and k not in ("M", "N", "K"))), launch.num_warps, launch.num_stages)
                    if key not in mixes:  # N and K are run-time ints: one binary serves every shape
                        mixes[key] = loop_mix(launch, CC)
                    p = predict(mixes[key], launch, N, K, gpu, latency_ns)
                    out.append(dict(gpu=gpu_name, model=model, layer=layer, weight=kind, N=N, K=K, **p))
                    total_bytes += launch_bytes(launch)
                    total_time += launch_bytes(launch) / p["predicted"]
                out.append(dict(gpu=gpu_name, model=model, layer="block", weight=kind, N="", K="",
                                predicted=total_bytes / total_time))
    return out


def main(argv: list[str] | None = None) -> None:
    from tritonq.cli import new_parser

    p = new_parser("python -m tritonq.bench model", __doc__.split("\n\n")[0])
    p.add_argument("--gpu", default="H100,H200", help=f"comma-separated, of {', '.join(GPUS)} (default: both)")
    p.add_argument("--weights", default=",".join(WEIGHT_TYPES), help="comma-separated weight types (default: all)")
    p.add_argument("--m", type=int, default=1, help="rows (tokens) of the decode step, <= 16 (default 1)")
    p.add_argument("--latency-ns", type=float, default=600.0,
                   help="assumed HBM latency under load in ns (default 600; an assumption, not a measurement)")
    p.add_argument("--blocks-only", action="store_true", help="print only the whole-block rows")
    args = p.parse_args(argv)
    gpus, kinds = args.gpu.split(","), args.weights.split(",")
    for name, known in (("--gpu", GPUS), ("--weights", WEIGHT_TYPES)):
        bad = [v for v in (gpus if name == "--gpu" else kinds) if v not in known]
        if bad:
            p.error(f"{name}: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    if not 1 <= args.m <= 16:
        p.error(f"--m {args.m}: the model covers the decode kernels, M in 1..16")
    if args.latency_ns <= 0:
        p.error(f"--latency-ns {args.latency_ns}: expected a positive number of nanoseconds")
    table = rows(gpus, kinds, args.m, args.latency_ns)
    print_table([r for r in table if r["layer"] == "block"] if args.blocks_only else table)


if __name__ == "__main__":
    main()
