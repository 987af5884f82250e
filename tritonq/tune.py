"""Launch-config tuner: `python -m tritonq.tune --kernel int4_gemm|fp8_gemm --shapes 16x4096x4096,...`.

For each shape, every candidate config of the kernel's declared search space is first checked
against the torch reference, then timed (triton.testing.do_bench); the fastest correct one is
written to tritonq/kernels/configs/<kernel>/<gpu-name>.json under the kernel's shape bucket,
where the launcher's `lookup` finds it at run time. Without a GPU:
  --dry-run   runs every candidate in the Triton interpreter on small shapes and checks it
              (the first correct candidate per bucket is written, to show the file round-trips);
  --aot sm_90 compiles every candidate for that GPU and prints shared memory, registers,
              spills and whether wgmma was used, rejecting candidates that spill or overflow.
--model PATH takes the GEMM shapes (N, K of every linear layer) from the model's config.json;
--where BLOCK_M=16,num_warps=4 narrows a sweep to the candidates with those values.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tritonq.bench.common import model_gemm_shapes, parse_shapes, print_table
from tritonq.kernels import configs

MODEL_M = (1, 16, 64, 256)  # decode, small batch, the int4/fp16 crossover, prefill


@dataclass(frozen=True)
class TuneTarget:
    """What the tuner needs from a kernel family.

    space(shape) -> the candidate launch configs legal for that shape ({"BLOCK_M": .., ...}).
    make_inputs(shape, device) -> inputs; run(inputs, config) -> output; reference(inputs) -> output.
    bucket(inputs) -> the key the launcher looks its config up under.
    aot(config, shape, cc) -> tritonq.kernels.aot.CompileReport.
    atol, rtol: output tolerance against the reference (set by the kernel's compute dtype).
    dry_run_shapes: small shapes for --dry-run in the interpreter.
    launch_only: config keys that change how a kernel compiles, not what it computes
    (num_warps, num_stages): the interpreter ignores them, so a dry run checks one per tile.
    """
    name: str
    space: Callable[[tuple[int, ...]], list[dict]]
    make_inputs: Callable
    run: Callable
    reference: Callable
    bucket: Callable
    aot: Callable
    atol: float
    rtol: float
    dry_run_shapes: tuple[tuple[int, ...], ...]
    launch_only: tuple[str, ...] = ("num_warps", "num_stages")


def _int4_group_size(K: int) -> int:
    return 128 if K % 128 == 0 else 32


def _int4_gemm_target() -> TuneTarget:
    import triton

    from tritonq.bench.int4_gemm import random_int4_weight
    from tritonq.kernels import int4_gemm as k

    def space(shape):
        """CONFIG_SPACE restricted to what is legal and useful for this shape: the decode path
        (M <= SPLIT_K_MAX_M) uses BLOCK_M 16 with split-K, larger M no split-K and BLOCK_M <= M;
        BLOCK_K divides the group size (else the launcher shrinks it) and fits K with its split."""
        M, N, K = shape
        s = k.CONFIG_SPACE
        small = M <= k.SPLIT_K_MAX_M
        out = []
        for bm, bn, bk, sk, warps, stages in itertools.product(
                s["BLOCK_M"], s["BLOCK_N"], s["BLOCK_K"], s["SPLIT_K"], s["num_warps"], s["num_stages"]):
            if (bm != 16 if small else (sk != 1 or bm > max(16, triton.next_power_of_2(M)))):
                continue
            if _int4_group_size(K) % bk or bk * sk > K or bn > max(32, triton.next_power_of_2(N)):
                continue
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=warps, num_stages=stages))
        return out

    def make_inputs(shape, device):
        M, N, K = shape
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        return torch.randn(M, K, dtype=dtype, device=device), random_int4_weight(N, K, dtype, device,
                                                                                  _int4_group_size(K))

    def aot(config, shape, cc):
        """The fp16, asymmetric, no-act-order, no-bias variant that AWQ/GPTQ checkpoints run."""
        pointers = {"x_ptr": "*fp16", "qweight_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*fp16",
                    "g_idx_ptr": "*i32", "bias_ptr": "*fp16", "out_ptr": "*fp32" if config["SPLIT_K"] > 1 else "*fp16"}
        flags = {"BITS": 4, "HAS_ZEROS": True, "HAS_G_IDX": False, "TILE_GROUPS": True, "HAS_BIAS": False,
                 "UPCAST_DOT": False, **{key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}}
        _, N, K = shape
        ints = {"N": N, "K": K, "group_size": _int4_group_size(K), "stride_xm": K}
        return _aot_with_flags(k._int4_gemm_kernel, pointers, flags, ints, config, cc)

    return TuneTarget(
        name="int4_gemm", space=space, make_inputs=make_inputs,
        run=lambda inputs, config: k.int4_gemm(*inputs, config=k.Int4GemmConfig(**config)),
        reference=lambda inputs: k.int4_gemm_reference(*inputs),
        bucket=lambda inputs: k.config_bucket(inputs[0].shape[0], *inputs[1].shape, inputs[1]),
        aot=aot,
        # fp16 products summed in fp32 vs the fp32 reference: K * eps_fp16 * |x||w| stays well under this
        # at the |y| ~ 1 these inputs give; fp32 inputs (CPU dry run) are far tighter.
        atol=2e-2, rtol=2e-2,
        dry_run_shapes=((1, 64, 128), (17, 96, 256)))


# fp8_gemm declares its config type (FP8GemmConfig) but no sweep list: these are the values swept.
# BLOCK_K 64/128 divide the 128-wide scale blocks, so every winner is valid for block weights too.
FP8_SPACE = {"BLOCK_M": [16, 32, 64, 128], "BLOCK_N": [32, 64, 128, 256], "BLOCK_K": [64, 128],
             "GROUP_M": [1, 8], "SPLIT_K": [1, 2, 4, 8, 16], "num_warps": [4, 8], "num_stages": [2, 3, 4]}


def _fp8_gemm_target() -> TuneTarget:
    """Tunes the path the runtime takes on this device: fp8 x fp8 (sm_89+) or weight-only below,
    stored under the kernel name the launcher looks up for that path."""
    import triton

    from tritonq.kernels import fp8_gemm as k
    from tritonq.quantize import quantize_fp8

    weight_only = torch.cuda.is_available() and k._lacks_fp8_tensor_cores(torch.device("cuda"))

    def space(shape):
        """Decode sizes (M <= 16) use BLOCK_M 16 and no GROUP_M swizzle; split-K only up to M 64."""
        M, N, K = shape
        out = []
        for values in itertools.product(*FP8_SPACE.values()):
            c = dict(zip(FP8_SPACE, values))
            if M <= 16 and (c["BLOCK_M"] != 16 or c["GROUP_M"] != 1):
                continue
            if c["BLOCK_M"] > max(16, triton.next_power_of_2(M)) or (M > 64 and c["SPLIT_K"] > 1):
                continue
            if c["BLOCK_N"] > max(32, triton.next_power_of_2(N)) or c["BLOCK_K"] * c["SPLIT_K"] > K:
                continue
            out.append(c)
        return out

    def make_inputs(shape, device):
        M, N, K = shape
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        w = quantize_fp8(torch.randn(N, K) * 0.05, scheme="block" if K % 128 == 0 else "channel")
        w = type(w)(**{f: (v.to(device) if isinstance(v, torch.Tensor) else v) for f, v in w.__dict__.items()})
        return torch.randn(M, K, dtype=dtype, device=device), w

    def aot(config, shape, cc):
        """Block-scaled (128x128) weights, fp16 activations: fp8 x fp8 from sm_89, weight-only below."""
        kernel = k._fp8_gemm_kernel
        no_fp8 = cc < 89
        pointers = {"a_ptr": "*fp16" if no_fp8 else "*fp8e4nv", "a_scale_ptr": "*fp32",
                    "w_ptr": "*u8" if no_fp8 else "*fp8e4nv", "w_scale_ptr": "*fp32", "bias_ptr": "*fp16",
                    "y_ptr": "*fp32" if config["SPLIT_K"] > 1 else "*fp16"}
        flags = {"A_GROUP": 128, "W_SCALE_BN": 128, "W_SCALE_BK": 128, "SCALE_PER_TILE": True,
                 "WEIGHT_ONLY": no_fp8, "HAS_BIAS": False,
                 **{key: config[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K")}}
        _, N, K = shape
        ints = {"N": N, "K": K, "stride_am": K, "stride_wn": K, "stride_ym": N}
        return _aot_with_flags(kernel, pointers, flags, ints, config, cc)

    return TuneTarget(
        name="fp8_gemm_weight_only" if weight_only else "fp8_gemm", space=space, make_inputs=make_inputs,
        run=lambda inputs, config: k.fp8_gemm(*inputs, weight_only=weight_only, config=k.FP8GemmConfig(**config)),
        reference=lambda inputs: k.fp8_gemm_reference(*inputs, weight_only=weight_only),
        bucket=lambda inputs: k.config_bucket(inputs[0].shape[0], *inputs[1].shape),
        aot=aot,
        # Kernel and reference quantize activations identically and accumulate in fp32; what is
        # left is summation order and the fp16 output rounding, far below this at |y| ~ 1.
        atol=2e-2, rtol=2e-2,
        dry_run_shapes=((1, 64, 256), (17, 96, 256)))


def _aot_with_flags(kernel, pointers: dict, flags: dict, ints: dict, config: dict, cc: int):
    """AOT-compile kernel: `pointers` typed as given, other runtime args i32, constexprs from flags.

    As the launcher specializes at run time, pointers and the 16-divisible `ints` get the hint.
    """
    from tritonq.kernels.aot import aot_compile

    params = [(p.name, p.is_constexpr) for p in kernel.params]
    unknown = [name for name, is_constexpr in params if is_constexpr and name not in flags]
    if unknown:
        raise ValueError(f"{kernel.__name__} has constexpr args {unknown} that tune's AOT variant does not set")
    signature = {name: pointers.get(name, "i32") for name, is_constexpr in params if not is_constexpr}
    constexprs = {name: flags[name] for name, is_constexpr in params if is_constexpr}
    aligned = [*pointers, *(name for name, value in ints.items() if value % 16 == 0)]
    return aot_compile(kernel, signature, constexprs, cc, num_warps=config["num_warps"],
                       num_stages=config["num_stages"], divisible_by_16=tuple(n for n in aligned if n in signature))


# Kernel families whose launcher takes a config; others are added as their launchers do.
TARGETS: dict[str, Callable[[], TuneTarget]] = {"int4_gemm": _int4_gemm_target, "fp8_gemm": _fp8_gemm_target}
# Their launchers read tuned JSON but take no config= argument yet, so candidates cannot be run.
NOT_YET_TUNABLE = ("moe", "attention")


def check_candidate(target: TuneTarget, inputs, config: dict) -> str | None:
    """None if the candidate's output matches the reference, else why not."""
    try:
        out = target.run(inputs, config)
    except Exception as e:  # a candidate the kernel rejects (e.g. BLOCK_K > group size) is skipped
        return f"{type(e).__name__}: {e}"
    ref = target.reference(inputs)
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = (out.float() - ref.float()).abs().max().item()
    if not torch.allclose(out.float(), ref.float(), atol=target.atol, rtol=target.rtol):
        return f"max abs error {err:.3g} over atol={target.atol}, rtol={target.rtol}"
    return None


def candidates(target: TuneTarget, shape: tuple[int, ...], timed: bool, where: dict | None = None) -> list[dict]:
    """The configs to try for `shape`: those matching `where`; untimed, one per distinct tile."""
    space = target.space(shape)
    unknown = set(where or {}) - {key for c in space for key in c}
    if unknown:
        raise ValueError(f"--where keys {sorted(unknown)} are not {target.name} config fields; "
                         f"fields: {sorted({key for c in space for key in c})}")
    space = [c for c in space if all(c.get(k) == v for k, v in (where or {}).items())]
    if timed:
        return space
    tiles = {}
    for c in space:
        tiles.setdefault(tuple((k, v) for k, v in c.items() if k not in target.launch_only), c)
    return list(tiles.values())


def tune(target: TuneTarget, shapes: list[tuple[int, ...]], device: torch.device, timed: bool,
         where: dict | None = None, progress: bool = True) -> dict[str, dict]:
    """{bucket: winning config} over `shapes`; candidates failing the reference check are dropped.

    timed=False (dry run) keeps the first correct candidate of each bucket, in declared order.
    """
    from tqdm import tqdm

    winners: dict[str, tuple[float, dict]] = {}
    spaces = [candidates(target, shape, timed, where) for shape in shapes]
    bar = tqdm(total=sum(map(len, spaces)), desc=target.name, disable=not progress)
    buckets = set()
    for shape, space in zip(shapes, spaces):
        inputs = target.make_inputs(shape, device)
        bucket = target.bucket(inputs)
        buckets.add(bucket)
        for config in space:
            bar.update()
            failure = check_candidate(target, inputs, config)
            if failure:
                bar.write(f"{shape} {config}: rejected ({failure})")
                continue
            if not timed:
                winners.setdefault(bucket, (0.0, config))
                continue
            import triton.testing
            ms = triton.testing.do_bench(lambda: target.run(inputs, config), warmup=25, rep=100)
            if bucket not in winners or ms < winners[bucket][0]:
                winners[bucket] = (ms, config)
    bar.close()
    missing = buckets - set(winners)
    if missing:
        raise RuntimeError(f"no candidate of {target.name} passed the reference check for buckets {sorted(missing)}")
    return {bucket: config for bucket, (_, config) in winners.items()}


def write_configs(kernel: str, gpu: str, winners: dict[str, dict], config_dir: Path) -> Path:
    """Merge winners into config_dir/<kernel>/<gpu>.json (other buckets are kept)."""
    path = config_dir / kernel / f"{gpu}.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    table.update(winners)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(sorted(table.items())), indent=1) + "\n")
    configs.load_configs.cache_clear()  # the runtime sees the new file in this process too
    return path


def aot_table(target: TuneTarget, shape: tuple[int, ...], cc: int, where: dict | None = None) -> list[dict]:
    """One row per candidate: config, shared memory, registers, spills, wgmma, verdict."""
    rows = []
    for config in candidates(target, shape, timed=True, where=where):
        try:
            r = target.aot(config, shape, cc)
        except Exception as e:
            rows.append({"config": _config_text(config), "verdict": f"rejected: {type(e).__name__}: {e}"[:100]})
            continue
        verdict = ("rejected: shared memory overflow" if not r.fits else
                   "rejected: register spills" if r.spills else "ok")
        rows.append({"config": _config_text(config), "shared_bytes": r.shared_bytes,
                     "registers": r.registers, "spills": r.spills, "wgmma": r.uses_wgmma, "verdict": verdict})
    return rows


def _config_text(config: dict) -> str:
    short = {"BLOCK_M": "BM", "BLOCK_N": "BN", "BLOCK_K": "BK", "SPLIT_K": "SK", "GROUP_M": "GM", "num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short.get(k, k)}{v}" for k, v in config.items())


def model_shapes(path: str | Path, ms: tuple[int, ...] = MODEL_M) -> list[tuple[int, int, int]]:
    """(M, N, K) for every linear layer of the model at `path` (folder or config.json) and M in ms."""
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


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m tritonq.tune", description=__doc__.split("\n")[0])
    p.add_argument("--kernel", required=True, choices=sorted([*TARGETS, *NOT_YET_TUNABLE]))
    p.add_argument("--shapes", default=None, help="comma-separated MxNxK (GEMMs)")
    p.add_argument("--model", default=None, help="model folder or config.json: tune its GEMM shapes")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check every candidate in the Triton interpreter")
    mode.add_argument("--aot", default=None, metavar="sm_XX", help="compile every candidate for this GPU")
    p.add_argument("--where", default="", metavar="KEY=V,...",
                   help="sweep only candidates with these values, e.g. BLOCK_M=16,num_warps=4")
    p.add_argument("--config-dir", default=str(configs.CONFIG_DIR), help="where <kernel>/<gpu>.json goes")
    args = p.parse_args(argv)

    if args.kernel in NOT_YET_TUNABLE:
        p.error(f"--kernel {args.kernel}: its launcher takes no config= argument yet, so there is nothing to "
                f"sweep; tunable now: {sorted(TARGETS)}")
    if args.aot:
        cc_text = args.aot.removeprefix("sm_").rstrip("a")
        if not cc_text.isdigit():
            p.error(f"--aot {args.aot!r}: expected a compute capability like sm_90 or sm_80")
        _reexec_with_interpreter(False, argv)
    if args.dry_run:
        _reexec_with_interpreter(True, argv)
    if not (args.dry_run or args.aot) and not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU; without one use --dry-run (interpreter check) or --aot sm_90")

    where = _parse_where(args.where)
    shapes = parse_shapes(args.shapes) if args.shapes else []
    if args.model:
        shapes += model_shapes(args.model)
    target = TARGETS[args.kernel]()
    if not shapes:
        if not (args.dry_run or args.aot):
            p.error("give --shapes MxNxK,... or --model PATH")
        shapes = list(target.dry_run_shapes)

    if args.aot:
        for shape in shapes:
            print(f"{target.name} {'x'.join(map(str, shape))} on {args.aot}:")
            print_table(aot_table(target, shape, int(cc_text), where))
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    winners = tune(target, shapes, device, timed=not args.dry_run, where=where)
    gpu = "cpu" if device.type == "cpu" else configs.gpu_name()
    path = write_configs(target.name, gpu, winners, Path(args.config_dir))
    print_table([{"bucket": b, "config": _config_text(c)} for b, c in sorted(winners.items())])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
