"""The search: a kernel's `TuneTarget` (built in tune/targets.py from what the kernel declares) swept over
shapes, every candidate checked against the reference, then timed; winners written where the
launchers' `common.tuned_or_default` reads them. `aot_table` compiles candidates instead (no GPU).
"""
from __future__ import annotations

import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tritonq.kernels import configs


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
    shape_format: what the ints of a --shapes entry mean, e.g. "MxNxK".
    problems(shape) -> the tuning problems a shape stands for, each with its own space, inputs and
    bucket (MoE: its gate/up and down GEMMs); by default the shape itself.
    default(problem) -> the launcher's default config in code for it (None: the kernel declares none), which
    `near_default` narrows a sweep around.
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
    shape_format: str = "MxNxK"
    problems: Callable[[tuple[int, ...]], list[tuple[int, ...]]] = lambda shape: [shape]
    default: Callable[[tuple[int, ...]], dict] | None = None


def kernel_dtype(device: torch.device) -> torch.dtype:
    """Activations of a tuning run: bf16 on GPUs (what the models run); fp32 in the interpreter,
    whose bf16 tl.dot is wrong."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_candidate(target: TuneTarget, inputs, config: dict, ref: torch.Tensor | None = None) -> str | None:
    """None if the candidate's output matches the reference (`ref`, computed if None), else why not."""
    try:
        out = target.run(inputs, config)
    except Exception as e:  # a candidate the kernel rejects (e.g. BLOCK_K > group size) is skipped
        return f"{type(e).__name__}: {e}"
    ref = target.reference(inputs) if ref is None else ref
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = (out.float() - ref.float()).abs().max().item()
    if not torch.allclose(out.float(), ref.float(), atol=target.atol, rtol=target.rtol):
        return f"max abs error {err:.3g} over atol={target.atol}, rtol={target.rtol}"
    return None


def near_default(target: TuneTarget, shape: tuple[int, ...], space: list[dict]) -> list[dict]:
    """The narrowed sweep (tune --near-default, the GPU session's): the kernel's default config for shape first,
    then the candidates of `space` that differ from it in one field: a few dozen cold compiles per shape, not
    hundreds, and never worse than the default (a winner must beat it on the same timer)."""
    if target.default is None:
        raise ValueError(f"--near-default: {target.name} declares no default config to narrow the sweep around")
    default = target.default(shape)
    near = [c for c in space if c != default and sum(c.get(k) != v for k, v in default.items()) == 1]
    return [default] + near


def candidates(target: TuneTarget, shape: tuple[int, ...], timed: bool, where: dict | None = None,
               narrow: bool = False) -> list[dict]:
    """The configs to try for `shape`: those matching `where` (with narrow, `near_default`'s); untimed, one per
    distinct tile."""
    space = target.space(shape)
    if narrow:
        space = near_default(target, shape, space)
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
         where: dict | None = None, progress: bool = True, narrow: bool = False,
         budget_s: float | None = None) -> dict[str, dict]:
    """{bucket: winning config} over the problems of `shapes`; failing candidates are dropped.

    budget_s: the sweep's wall-clock budget. Each problem gets an equal share of what is left (time a problem
    does not use passes to the next), its candidates in order (`near_default`'s: the default first) until
    the share is spent; the best so far is kept, and a bucket none of whose candidates ran everywhere in time is
    left out (the launcher keeps its default there) instead of failing the run.

    A winner must pass on every problem of its bucket. Timed, it has the least geometric-mean time
    over them: one attention bucket (its head dims) may cover shapes of very different cost, and
    the geometric mean weighs each shape's relative speedup alike. timed=False (dry run) keeps the
    first such candidate in declared order.
    """
    from tritonq.progress import progress_bar

    problems = [problem for shape in shapes for problem in target.problems(shape)]
    spaces = [candidates(target, problem, timed, where, narrow) for problem in problems]
    deadline = None if budget_s is None else time.monotonic() + budget_s
    bar = progress_bar(total=sum(map(len, spaces)), desc=target.name, unit="config", enabled=progress)
    per_bucket = Counter()
    passed: dict[str, dict[str, list]] = {}  # bucket -> config text -> [config, problems passed, sum of log ms]
    for i, (problem, space) in enumerate(zip(problems, spaces)):
        share_end = None if deadline is None else time.monotonic() + (deadline - time.monotonic()) / (len(problems) - i)
        inputs = target.make_inputs(problem, device)
        bucket = target.bucket(inputs)
        per_bucket[bucket] += 1
        entries = passed.setdefault(bucket, {})
        ref = target.reference(inputs)
        for config in space:
            if share_end is not None and time.monotonic() > share_end:
                bar.write(f"{problem}: its share of the {budget_s:g} s budget is spent; best of the configs tried")
                break
            bar.update()
            failure = check_candidate(target, inputs, config, ref)
            if failure:
                bar.write(f"{problem} {config}: rejected ({failure})")
                continue
            ms = 1.0
            if timed:
                import triton.testing
                ms = triton.testing.do_bench(lambda inputs=inputs, config=config: target.run(inputs, config),
                                             warmup=25, rep=100)
            entry = entries.setdefault(json.dumps(config, sort_keys=True), [config, 0, 0.0])
            entry[1] += 1
            entry[2] += math.log(max(ms, 1e-9))
    bar.close()
    winners = {}
    for bucket, entries in passed.items():
        everywhere = [entry for entry in entries.values() if entry[1] == per_bucket[bucket]]
        if everywhere:  # min keeps the first of equal times: the declared order in a dry run
            winners[bucket] = min(everywhere, key=lambda entry: entry[2])[0]
    missing = set(per_bucket) - set(winners)
    if missing and budget_s is not None:
        print(f"{target.name}: no candidate ran everywhere within the budget for {sorted(missing)}; not written")
    elif missing:
        raise RuntimeError(f"no candidate of {target.name} passed the reference check (on every shape of the "
                           f"bucket) for buckets {sorted(missing)}")
    return winners


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


