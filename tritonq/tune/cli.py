"""Launch-config tuner: `python -m tritonq.tune --kernel KERNEL --shapes SHAPE,...`.

Kernels and their --shapes format (x-separated ints):
  int4_gemm, fp8_gemm  MxNxK                   (or --model PATH: every linear layer of the model)
  attention_prefill    BxSxHxHkvxDqkxDv        prompts, tokens, query heads, kv heads, head dims (16-token pages)
  attention_decode     BxSmaxxHxHkvxDqkxDv     batch, cache capacity, heads, head dims (16-token pages)
  moe                  TxExTOPKxDxI            tokens, experts, experts per token, hidden, intermediate
                                               (int4 group-128 experts; its two GEMMs are tuned apart)
Each kernel declares in its own file what is swept (its sweep space, shape format and AOT launch
builder); targets.py adds what only the tuner needs (random inputs, the torch reference, the tolerance)
into one `TuneTarget` per kernel; search.py is the generic part (check, time, pick, write); cli.py
this command.
For each shape, every candidate config of the kernel's declared search space is first checked
against the torch reference, then timed (triton.testing.do_bench); the fastest correct one is
written to tritonq/kernels/configs/<kernel>/<gpu-name>.json under the kernel's shape bucket,
where the launcher's `lookup` finds it at run time. Without a GPU:
  --dry-run   runs every candidate in the Triton interpreter on small shapes and checks it
              (the first correct candidate per bucket is written, to show the file round-trips);
  --aot sm_90 compiles every candidate for that GPU and prints shared memory, registers,
              spills and whether wgmma was used, rejecting candidates that spill or overflow.
--where BLOCK_M=16,num_warps=4 narrows a sweep to the candidates with those values; --near-default to the
kernel's default config and those one field away from it (int4_gemm, fp8_gemm, moe: a few dozen per shape
instead of hundreds of cold compiles); --budget SECONDS stops the sweep when the time is spent, sharing it
equally over the shapes, and writes the best config found so far per bucket (bench/gpu_session.sh's STEP=tune).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tritonq.tune.search import TuneTarget

# torch and the kernels are imported after the arguments are parsed: `--help` answers at once
CONFIG_DIR = Path(__file__).parents[1] / "kernels" / "configs"  # tritonq.kernels.configs.CONFIG_DIR
MODEL_M = (1, 16, 64, 256)  # decode, small batch, the int4/fp16 crossover, prefill


def _target(kernel: str) -> Callable[[], TuneTarget]:
    """The builder of `kernel`'s target in tune/targets.py, imported (with torch) when asked for."""
    return lambda: getattr(importlib.import_module("tritonq.tune.targets"), kernel)()


TARGETS: dict[str, Callable[[], TuneTarget]] = {
    kernel: _target(kernel) for kernel in ("int4_gemm", "fp8_gemm", "attention_prefill", "attention_decode", "moe")}


def model_shapes(path: str | Path, ms: tuple[int, ...] = MODEL_M) -> list[tuple[int, int, int]]:
    """(M, N, K) for every linear layer of the model at `path` (folder or config.json) and M in ms."""
    from tritonq.workbench import model_gemm_shapes

    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.exists():
        raise ValueError(f"--model {path}: no config.json found; pass a model folder or its config.json")
    layers = model_gemm_shapes(json.loads(config_path.read_text()))
    return sorted({(M, N, K) for M in ms for _, N, K in layers})


def _parse_where(text: str) -> dict:
    where = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            raise ValueError(f"bad --where item {item!r}: expected KEY=INT, e.g. BLOCK_M=16")
        where[key] = int(value)
    return where


def _reexec_with_interpreter(interpret: bool, argv: list[str]) -> None:
    """The interpreter is chosen when @triton.jit runs (at import), so switch it by restarting."""
    if (os.environ.get("TRITON_INTERPRET") == "1") == interpret:
        return
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    os.execve(sys.executable, [sys.executable, "-m", "tritonq.tune", *argv], env)


def build_parser(prog: str = "python -m tritonq.tune") -> argparse.ArgumentParser:
    from tritonq.cli import new_parser

    p = new_parser(prog, __doc__)
    p.add_argument("--kernel", required=True, choices=sorted(TARGETS), help="the kernel whose configs are swept")
    p.add_argument("--shapes", default=None,
                   help="comma-separated shapes in the kernel's format (see above), e.g. 1x4096x4096")
    p.add_argument("--model", default=None, help="model folder or config.json: tune its GEMM shapes (GEMMs only)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check every candidate in the Triton interpreter")
    mode.add_argument("--aot", default=None, metavar="sm_XX", help="compile every candidate for this GPU")
    p.add_argument("--where", default="", metavar="KEY=V,...",
                   help="sweep only candidates with these values, e.g. BLOCK_M=16,num_warps=4")
    p.add_argument("--near-default", action="store_true",
                   help="sweep only the default config and those one field away from it")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="stop after this many seconds and write the best configs found so far")
    p.add_argument("--config-dir", default=str(CONFIG_DIR), help="where <kernel>/<gpu>.json goes")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m tritonq.tune") -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = build_parser(prog)
    args = p.parse_args(argv)

    if args.aot:
        cc_text = args.aot.removeprefix("sm_").rstrip("a")
        if not cc_text.isdigit():
            p.error(f"--aot {args.aot!r}: expected a compute capability like sm_90 or sm_80")
        _reexec_with_interpreter(False, argv)
    if args.dry_run:
        _reexec_with_interpreter(True, argv)
    import torch

    from tritonq.workbench import parse_shapes, print_table
    from tritonq.kernels import configs
    from tritonq.kernels.common import shape_fields
    from tritonq.tune.search import _config_text, aot_table, tune, write_configs

    if not (args.dry_run or args.aot) and not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU; without one use --dry-run (interpreter check) or --aot sm_90")

    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget {args.budget:g}: expected a positive number of seconds")
    where = _parse_where(args.where)
    target = TARGETS[args.kernel]()
    if args.near_default and target.default is None:
        p.error(f"--near-default: {args.kernel} declares no default config; drop the flag or narrow with --where")
    shapes = parse_shapes(args.shapes) if args.shapes else []
    for shape in shapes:
        if len(shape) != len(shape_fields(target.shape_format)):
            p.error(f"--shapes {'x'.join(map(str, shape))}: {args.kernel} shapes are {target.shape_format}")
    if args.model:
        if target.shape_format != "MxNxK":
            p.error(f"--model gives GEMM shapes; for --kernel {args.kernel} pass --shapes {target.shape_format},...")
        shapes += model_shapes(args.model)
    if not shapes:
        if not (args.dry_run or args.aot):
            p.error(f"give --shapes {target.shape_format},..." + (" or --model PATH" if args.model is None
                                                                    and target.shape_format == "MxNxK" else ""))
        shapes = list(target.dry_run_shapes)
    for shape in shapes:  # a bad shape (e.g. H not a multiple of Hkv) fails here, before any sweep
        try:
            target.problems(shape)
            for problem in target.problems(shape):
                target.space(problem)
        except ValueError as e:
            p.error(f"--shapes: {e}")

    if args.aot:
        for shape in shapes:
            for problem in target.problems(shape):
                print(f"{target.name} {'x'.join(map(str, problem))} on {args.aot}:")
                print_table(aot_table(target, problem, int(cc_text), where))
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    winners = tune(target, shapes, device, timed=not args.dry_run, where=where, narrow=args.near_default,
                   budget_s=args.budget)
    gpu = "cpu" if device.type == "cpu" else configs.gpu_name()
    path = write_configs(target.name, gpu, winners, Path(args.config_dir))
    print_table([{"bucket": b, "config": _config_text(c)} for b, c in sorted(winners.items())])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
