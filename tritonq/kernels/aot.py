"""Ahead-of-time compile a @triton.jit kernel for a GPU we do not have.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` runs the whole NVIDIA
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin via the bundled ptxas) on a CPU-only
machine. This catches what the interpreter forgives (dtype mixes, unsupported ops, shared
memory overflow) and shows whether the dots use tensor cores (mma.sync, sm_90's wgmma). Used by tests and `tune --aot`.
`compile_launch` compiles a `kernels.common.Launch` built by a kernel's own launch builder over
meta tensors, typing and hinting each argument as Triton's runtime would for real ones;
`launch_ttir` gives the same launch's front-end IR (integer widths of the address arithmetic).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Max dynamic shared memory per block (bytes) by compute capability.
SHARED_MEMORY_LIMIT = {75: 65536, 80: 166912, 86: 101376, 89: 101376, 90: 232448}
# SMs of the usual GPU of each compute capability (T4, A100, A10/RTX 3090-class, L4/L40-class
# ~128, H100/H200 SXM): launch builders that size grids by SM count (split-KV decode) get these.
SM_COUNT = {75: 40, 80: 108, 86: 84, 89: 128, 90: 132}

# torch dtype -> Triton's pointer element type name in a signature
_POINTER_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32", "int64": "i64",
                  "uint8": "u8", "int8": "i8", "float8_e4m3fn": "fp8e4nv"}


@dataclass(frozen=True)
class CompileReport:
    cc: int
    shared_bytes: int
    registers: int | None
    spills: int | None
    uses_wgmma: bool
    # Operand types of the tensor-core instructions (mma.sync / wgmma), e.g. ("bf16",); "tf32" means an
    # fp32 tl.dot runs on 10-bit mantissas. Empty: no tensor cores (an IEEE fp32 dot is FMAs).
    mma_types: tuple[str, ...] = ()
    # fp32 division instructions, e.g. ("div.rn.f32",): IEEE round-to-nearest; div.full / div.approx
    # are approximate (Triton's `/` on fp32 is div.full.f32) and differ from torch in the last bits.
    fp32_divisions: tuple[str, ...] = ()
    uses_mma: bool = False  # mma.sync (sm_80+ tensor cores; Triton 3.x lowers tl.dot to FMA before sm_80)

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_MEMORY_LIMIT.get(self.cc, 49152)


def aot_compile(kernel, signature: dict, constexprs: dict, cc: int, num_warps: int = 4,
                num_stages: int = 3, divisible_by_16: tuple[str, ...] = ()) -> CompileReport:
    """Compile `kernel` for sm_`cc`.

    signature: {arg_name: type string}, e.g. {"x_ptr": "*fp16", "M": "i32"}; constexpr args
    are given in `constexprs` ({name: value}) and are typed "constexpr" automatically.
    divisible_by_16: pointer/int args to mark 16-divisible, as the runtime launcher does for
    such values; without it loads are not vectorized and cp.async pipelining is skipped.
    """
    compiled = _compile(kernel, signature, constexprs, cc, num_warps, num_stages, divisible_by_16)
    ptx = compiled.asm.get("ptx", "")
    registers = spills = None
    n_regs = getattr(compiled, "n_regs", None)
    n_spills = getattr(compiled, "n_spills", None)
    if isinstance(n_regs, int) and n_regs > 0:
        registers, spills = n_regs, n_spills
    else:  # metadata is filled on first GPU load; read ptxas' own report from the cubin instead
        registers, spills = _ptxas_usage(ptx, cc)
    mma = re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\.\S+", ptx)
    return CompileReport(cc=cc, shared_bytes=int(compiled.metadata.shared),
                         registers=registers, spills=spills,
                         uses_wgmma=bool(re.search(r"\bwgmma\.", ptx)),
                         uses_mma=bool(re.search(r"\bmma\.sync\b", ptx)),
                         mma_types=tuple(sorted({t for instr in mma for t in re.findall(
                             r"\.(f16|bf16|tf32|e4m3|e5m2|f64|s8|u8|s4|u4)(?=\.|\s|$)", instr)})),
                         fp32_divisions=tuple(sorted(set(re.findall(r"\bdiv(?:\.[a-z]+)*\.f32\b", ptx)))))


def _compile(kernel, signature: dict, constexprs: dict, cc: int, num_warps: int, num_stages: int,
             divisible_by_16: tuple[str, ...]):
    """triton.compile for sm_`cc` (see aot_compile): the compiled kernel, its PTX and cubin in .asm."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel
    while not hasattr(fn, "arg_names"):  # unwrap @triton.autotune / @triton.heuristics
        fn = fn.fn
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in divisible_by_16}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _ptxas_usage(ptx: str, cc: int) -> tuple[int | None, int | None]:
    """Run the ptxas bundled with triton with -v to read registers and spill bytes."""
    import os
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(cc).path
    except Exception:
        return None, None
    arch = f"sm_{cc}a" if cc == 90 else f"sm_{cc}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.findall(r"(\d+) bytes spill stores", text)
    return (int(regs.group(1)) if regs else None, sum(map(int, spill)) if spill else 0)


def _launch_signature(launch, ones: bool = False) -> tuple[dict, dict, tuple[str, ...]]:
    """(signature, constexprs, 16-divisible names) of a `kernels.common.Launch`: tensors become typed
    pointers, Python floats fp32, ints i32 (i64 when they need it); as the runtime specializes real
    launches, pointers and ints divisible by 16 get the divisibility hint. Constexpr parameters take
    their values; parameters the launch leaves out take their defaults (an optional pointer's None is a
    constexpr, as the runtime specializes it). ones: ints equal to 1 become constexprs too, as the runtime
    makes them (unit strides, M = 1): the exact binary of a decode launch, for its SASS (`loop_mix`);
    without it one compile stands for every M and stride (test_fit, tune --aot, the IR readers)."""
    import torch

    signature, constexprs, aligned = {}, {}, []
    for p in launch.kernel.params:
        value = launch.args[p.name] if p.name in launch.args or not p.has_default else p.default
        if p.is_constexpr or value is None:  # None: an optional pointer left out, specialized away as at run time
            constexprs[p.name] = value
        elif isinstance(value, torch.Tensor):
            signature[p.name] = "*" + _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
            aligned.append(p.name)
        elif isinstance(value, float):
            signature[p.name] = "fp32"
        elif ones and type(value) is int and value == 1:
            constexprs[p.name] = 1
        elif isinstance(value, int):
            signature[p.name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0:
                aligned.append(p.name)
        else:
            raise TypeError(f"compile_launch: argument {p.name} = {value!r} of {launch.kernel.__name__} has no "
                            "Triton type here (expected a tensor, int or float)")
    return signature, constexprs, tuple(aligned)


def global_memory_ops(launch, cc: int) -> dict[str, int]:
    """{SASS opcode: count} of a `kernels.common.Launch`'s global and local memory instructions on sm_`cc`
    (LDG / LDGSTS / STG with their width suffix, e.g. "LDGSTS.E.BYPASS.128": a 16-byte cp.async; LDL / STL: local
    memory, i.e. spills or a stack array), read by the cuobjdump bundled with Triton from the compiled cubin."""
    import collections
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    signature, constexprs, aligned = _launch_signature(launch)
    fn = launch.kernel
    src = ASTSource(fn=fn, signature=dict(signature, **{name: "constexpr" for name in constexprs}),
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    cuobjdump = os.path.join(os.path.dirname(get_ptxas(cc).path), "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
    return dict(collections.Counter(re.findall(r"\b((?:LDGSTS|LDG|STG|LDL|STL)(?:\.\w+)*)\b", sass)))


def compile_launch(launch, cc: int) -> CompileReport:
    """AOT-compile a `kernels.common.Launch` for sm_`cc`, its arguments typed as `_launch_signature` says."""
    signature, constexprs, aligned = _launch_signature(launch)
    return aot_compile(launch.kernel, signature, constexprs, cc, launch.num_warps, launch.num_stages,
                       divisible_by_16=aligned)


def launch_ttir(launch, cc: int = 90) -> str:
    """The Triton IR (TTIR, without locations) the front end generates for a `kernels.common.Launch`, before
    any optimization pass: what the kernel source computes, in which integer widths (e.g. whether a row x
    stride product is i32 or i64). Fast (no LLVM, no ptxas); typed as `compile_launch` types it."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    signature, constexprs, aligned = _launch_signature(launch)
    fn = launch.kernel
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs={(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned})
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    return module.str_nodebug()


# SASS opcodes (the name before the first dot) that are not arithmetic: memory, control flow, barriers and
# the tensor-core instructions; `LoopMix.alu` counts every other instruction of the loop.
_NOT_ALU = re.compile(r"^(LD\w*|ST\w*|RED|ATOM\w*|BRA|BAR|BSSY|BSYNC|DEPBAR|LDGDEPBAR|WARPSYNC|NOP|EXIT|YIELD|"
                      r"ARRIVES|SYNCS|HMMA|IMMA|HGMMA|IGMMA|QGMMA|WARPGROUP\w*|MEMBAR|CCTL\w*|ERRBAR|FENCE)$")


@dataclass(frozen=True)
class LoopMix:
    """The SASS of one compiled launch, summarized: the instructions (full opcodes with modifiers, e.g.
    "LDG.E.128") of its main loop, the body of its longest backward branch, as one thread runs them per
    iteration, and the local-memory instructions (LDL / STL: spills) anywhere in the kernel."""
    cc: int
    loop: dict[str, int]
    local_memory: int
    registers: int | None  # per thread
    shared_bytes: int  # per program

    def count(self, prefix: str) -> int:
        """Loop instructions whose opcode starts with `prefix` ("I2F", "LDG.E.128", "HMMA")."""
        return sum(n for op, n in self.loop.items() if op.startswith(prefix))

    @property
    def alu(self) -> int:
        """Arithmetic instructions in the loop (integer, float, conversion, move, predicate)."""
        return sum(n for op, n in self.loop.items() if not _NOT_ALU.match(op.split(".")[0]))

    @property
    def total(self) -> int:
        return sum(self.loop.values())


def launch_sass(launch, cc: int) -> tuple[str, int]:
    """(SASS, shared memory bytes) of a `kernels.common.Launch` compiled for sm_`cc`: the SASS after its
    resource usage ("REG:n ..."), from Triton's bundled `cuobjdump --dump-resource-usage --dump-sass`."""
    import os
    import subprocess
    import tempfile

    import triton

    signature, constexprs, aligned = _launch_signature(launch, ones=True)
    compiled = _compile(launch.kernel, signature, constexprs, cc, launch.num_warps, launch.num_stages, aligned)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([cuobjdump, "--dump-resource-usage", "--dump-sass", path], capture_output=True,
                              text=True, check=True).stdout
    return sass, int(compiled.metadata.shared)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def loop_mix(launch, cc: int) -> LoopMix:
    """`LoopMix` of a launch compiled for sm_`cc`. ValueError if its SASS has no loop."""
    sass, shared = launch_sass(launch, cc)
    instructions = [(int(address, 16), op, operands) for address, op, operands in _SASS_LINE.findall(sass)]
    loops = [(int(target.group(1), 16), address) for address, op, operands in instructions
             if op.startswith("BRA") and (target := re.search(r"0x([0-9a-f]+)", operands))
             and int(target.group(1), 16) < address]
    if not loops:
        raise ValueError(f"loop_mix: {launch.kernel.__name__} compiled for sm_{cc} has no backward branch (no loop)")
    first, last = max(loops, key=lambda loop: loop[1] - loop[0])
    loop: dict[str, int] = {}
    for address, op, _ in instructions:
        if first <= address <= last:
            loop[op] = loop.get(op, 0) + 1
    local = sum(1 for _, op, _ in instructions if op.split(".")[0] in ("LDL", "STL"))
    registers = re.search(r"REG:(\d+)", sass)
    return LoopMix(cc=cc, loop=loop, local_memory=local, registers=int(registers.group(1)) if registers else None,
                   shared_bytes=shared)
