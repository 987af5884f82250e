"""Host path of the quantized linears: `python -m tritonq.bench host [--n 4096] [--k 4096] [--calls 300]`.

For each weight type (int4 AWQ, GPTQ act-order, GPTQ 8-bit, nf4, FP8 per-tensor / per-channel / block, FP8
weight-only, W8A8) and M = 1 / 16 / 256, a `layers.Linear` over an N x K weight on the meta device, so no GPU is
needed: meta tensors stand for CUDA ones (`kernels.common.on_gpu`) and the Triton launch itself is stubbed (it
counts and returns). Reported per call: host microseconds (tritonq's Python from the Linear call up to Triton's
launcher; Triton's own argument binding and the driver are not in it), min over rounds of the mean over `--calls`
calls after a warm-up call (which builds the plan), and device launches: Triton kernels plus the torch ops that
would run a kernel on a GPU (everything but allocations and views, counted by a dispatch mode in a separate pass).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# The kernels must be interpreter objects whose launch is stubbed below, whatever the caller's environment.
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tritonq.quant.weights import FP8Weight, Int4Weight, W8A8Weight  # noqa: E402

MS = (1, 16, 256)
META = torch.device("meta")
# aten ops that run no device kernel: allocations, views and metadata
NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "expand",
             "unsqueeze", "squeeze", "select", "slice", "alias", "detach", "_reshape_alias", "lift_fresh", "reshape"}


def weights(N: int, K: int) -> dict[str, object]:
    """One meta weight per type, as the loaders hand them to Linear (fp16 scales, group 128; nf4 block 64)."""
    def empty(*shape, dtype=torch.float16):
        return torch.empty(*shape, dtype=dtype, device=META)

    def int4(bits=4, zeros=True, act_order=False, code=False):
        group = 64 if code else 128
        scales = empty(K // group, N, dtype=torch.float32 if code else torch.float16)
        return Int4Weight(empty(K * bits // 32, N, dtype=torch.int32), scales,
                          empty(K // group, N) if zeros and not code else None,
                          empty(K, dtype=torch.int32) if act_order else None, group, bits,
                          code=empty(16, dtype=torch.float32) if code else None)

    fp8, f32 = empty(N, K, dtype=torch.float8_e4m3fn), torch.float32
    return {
        "int4 AWQ (asym, g128)": int4(),
        "int4 GPTQ act-order": int4(zeros=False, act_order=True),
        "int8 GPTQ (weight-only)": int4(bits=8),
        "nf4 (bitsandbytes)": int4(code=True),
        "FP8 per-tensor": FP8Weight(fp8, empty((), dtype=f32)),
        "FP8 per-channel": FP8Weight(fp8, empty(N, 1, dtype=f32)),
        "FP8 block 128x128": FP8Weight(fp8, empty(-(N // -128), -(K // -128), dtype=f32), block_size=(128, 128)),
        "FP8 weight-only": FP8Weight(fp8, empty(N, 1, dtype=f32), weight_only=True),
        "W8A8 (per-token)": W8A8Weight(empty(N, K, dtype=torch.int8), empty(N, 1, dtype=f32)),
    }


class _KernelOps(TorchDispatchMode):
    """Counts the aten ops that would run a device kernel."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _StubbedLaunches:
    """Within the block, a Triton kernel launch counts itself and returns (no interpreter run, no compile)."""

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        self.runs, self.count = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}, 0

        def stub(fn, *args, grid, warmup, **kwargs):
            self.count += 1

        for cls in self.runs:
            cls.run = stub
        return self

    def __exit__(self, *exc):
        for cls, run in self.runs.items():
            cls.run = run


def measure(layer, x: torch.Tensor, calls: int, rounds: int = 5) -> tuple[float, float]:
    """(host us per call, device launches per call) of layer(x), warm."""
    with _StubbedLaunches() as triton_launches:
        layer(x)  # builds the plan for this M bucket
        triton_launches.count = 0
        with _KernelOps() as torch_ops:
            layer(x)
        launches = triton_launches.count + torch_ops.count
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                layer(x)
            best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6, launches


def run(N: int, K: int, calls: int, dtype: torch.dtype = torch.float16) -> list[dict]:
    from tritonq.formats.layers import Linear

    rows = []
    for name, w in weights(N, K).items():
        layer = Linear(w)
        for M in MS:
            us, launches = measure(layer, torch.empty(M, K, dtype=dtype, device=META), calls)
            rows.append(dict(weight=name, M=M, host_us=round(us, 1), launches=launches))
    return rows


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m tritonq.bench host", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4096, help="output features N")
    p.add_argument("--k", type=int, default=4096, help="input features K (a multiple of 128)")
    p.add_argument("--calls", type=int, default=300, help="calls per timed round")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    if args.k % 128 or args.n < 1 or args.calls < 1:
        p.error(f"--k {args.k} must be a multiple of 128 (the weights' group), --n and --calls positive")
    rows = run(args.n, args.k, args.calls)
    print(f"host path per Linear call, N={args.n} K={args.k} fp16 activations, meta device (launch stubbed)")
    print(f"{'weight':<26}" + "".join(f"{'M=' + str(m) + ' us':>12}{'launches':>10}" for m in MS))
    for i in range(0, len(rows), len(MS)):
        group = rows[i:i + len(MS)]
        print(f"{group[0]['weight']:<26}" + "".join(f"{r['host_us']:>12.1f}{r['launches']:>10}" for r in group))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(benchmark="host", N=args.n, K=args.k, rows=rows), indent=1))
