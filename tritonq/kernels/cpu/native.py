"""The CPU backend's C library (csrc/, its exports declared in csrc/tritonq_cpu.h): paged attention over the pages
in place, RMSNorm (after a residual addition or not), SwiGLU's silu(g) * u, linears over rows, rotary embedding, the
KV write and greedy sampling rows: what torch does in many small ops per row, or (attention over pages) not at all.

Built on first use with the system C compiler (`$CC`, else cc / gcc / clang) into the cache folder
($TRITONQ_CACHE_DIR, else ~/.cache/tritonq), named by a hash of the sources, flags, compiler version and CPU flags.
A function returns None where the library is not built (the log says why, once), where the call is outside what
it takes, or inside a torch.compile trace: the caller runs its torch path. Parallel calls run on torch's own OpenMP
team (GOMP_parallel). Why C, and the measurements: docs/cpu.md.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # the C sources; tritonq_cpu.h declares what they export
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros"]  # reassociation: vectorised dot products and sums
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS.append("-mprefer-vector-width=512")  # AVX-512 registers where the CPU has them (gcc/clang default to 256)
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
QUERY_ROWS = 32  # query rows (queries x the query heads of a kv head) per attention work item

_INT, _I64, _PTR, _FLOAT = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# The library's exports as ctypes declares them: name -> (restype, argtypes), one entry per prototype of
# csrc/tritonq_cpu.h (tests/kernels/cpu/test_cpu_abi.py parses the header and compares).
SIGNATURES = {
    "tritonq_paged_attention": (_INT, [_PTR, _INT, _INT, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                       _I64, _I64, _I64, _FLOAT, _PTR, _I64]),
    "tritonq_has_float16": (_INT, []),
    "tritonq_greedy_rows": (None, [_PTR, _I64, _I64, _I64, _PTR, _PTR]),
    "tritonq_rms_norm": (_INT, [_INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _FLOAT, _PTR, _PTR]),
    "tritonq_silu_mul": (_INT, [_INT, _PTR, _I64, _I64, _I64, _PTR]),
    "tritonq_rope": (_INT, [_INT, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR]),
    "tritonq_write_kv": (_INT, [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64]),
    "tritonq_small_linear": (_INT, [_PTR, _INT, _INT, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR]),
    "tritonq_int8_linear": (_INT, [_PTR, _INT, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR]),
    "tritonq_gguf_linear": (_INT, [_PTR, _INT, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR,
                                   _I64, _I64, _PTR, _PTR]),
}


def cache_dir() -> Path:
    """Where built kernels are kept: $TRITONQ_CACHE_DIR, else ~/.cache/tritonq."""
    return Path(os.environ.get("TRITONQ_CACHE_DIR") or Path.home() / ".cache" / "tritonq")


def _compiler() -> str | None:
    for name in filter(None, (os.environ.get("CC"), "cc", "gcc", "clang")):
        if shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    """This CPU's feature flags (-march=native builds for them), from /proc/cpuinfo where there is one."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, loaded; None (logged once) when there is no C compiler or the build fails."""
    compiler = _compiler()
    if compiler is None:
        log.warning("CPU kernels: no C compiler found ($CC, cc, gcc, clang); attention runs torch's flash "
                    "kernel over gathered keys instead, and RMSNorm and greedy sampling torch's ops (slower: see "
                    "tritonq/kernels/cpu/native.py)")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        sources = sorted(CSRC.glob("*.[ch]"))
        texts = [f"{path.name}\0{path.read_text()}" for path in sources]
        key = hashlib.sha256("\0".join([*texts, *FLAGS, version, _cpu_flags(), platform.machine()])
                             .encode()).hexdigest()[:16]
        target = cache_dir() / "native" / f"cpu_native-{key}.so"
        if not target.exists():
            start = time.perf_counter()
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, then renamed: atomic
                built = Path(tmp) / target.name
                c_files = [str(path) for path in sources if path.suffix == ".c"]
                done = subprocess.run([compiler, *FLAGS, *c_files, "-o", str(built)], capture_output=True, text=True,
                                      timeout=300)
                if done.returncode:
                    raise RuntimeError(f"{compiler} exited with {done.returncode}: "
                                       f"{(done.stderr.strip().splitlines() or ['no message'])[-1]}")
                os.replace(built, target)
            log.info("CPU kernels: built %s with %s in %.1f s (%s)", CSRC, compiler,
                     time.perf_counter() - start, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("CPU kernels: building %s failed (%s); attention runs torch's flash kernel over "
                    "gathered keys instead, and RMSNorm and greedy sampling torch's ops (slower)", CSRC, error)
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
    return lib


def _library_for(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The built kernels when they compute dtype (float32, bfloat16, float16 where the compiler has _Float16), else
    None."""
    if dtype not in DTYPES or torch.compiler.is_compiling():  # a compiled step traces the callers' torch ops
        return None
    lib = library()
    return None if lib is None or (dtype == torch.float16 and not lib.tritonq_has_float16()) else lib


@functools.cache
def omp_parallel() -> int | None:
    """The address of GOMP_parallel in the OpenMP runtime torch's own ops run on (torch's libgomp; LLVM's and Intel's
    runtimes export it too), for the attention kernel's thread team; None (one thread) when torch's parallel backend
    is not OpenMP or the runtime is not found among the process's mapped libraries."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        maps = []
    paths = dict.fromkeys(line.split(None, 5)[-1] for line in maps
                          if any(name in line for name in ("libgomp", "libiomp", "libomp")))
    for path in paths:
        try:
            return ctypes.cast(ctypes.CDLL(path).GOMP_parallel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
    log.info("CPU kernels: torch's OpenMP runtime was not found; attention runs on one thread")
    return None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as rows [R, D] with D contiguous (x itself when it is such rows: a reshape and a view are ~1-2 us
    each, next to a C call of a few on a decode step's rows)."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _int32(x: torch.Tensor) -> torch.Tensor:
    """x as a contiguous int32 tensor (x itself when it is one)."""
    return (x if x.dtype == torch.int32 else x.to(torch.int32)).contiguous()


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    context_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                    window: int) -> torch.Tensor | None:
    """q [T, H, D] packed -> [T, H, D]: sequence b's queries rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 at positions
    ctx - n_q .. ctx - 1 (ctx = context_lens[b]; a decode row is n_q = 1), causal over keys
    max(0, position - window + 1) .. position (window 0: from 0), read in place from pages [P, page_size, Hkv, D]
    (page_size a power of two). None when this kernel does not take the call (pages of another dtype than q's,
    Dqk != Dv, pages not contiguous, a page size not a power of two) or is not built."""
    if (k_pages.dtype != q.dtype or v_pages.dtype != q.dtype or k_pages.shape != v_pages.shape
            or k_pages.shape[-1] != q.shape[-1] or not (k_pages.is_contiguous() and v_pages.is_contiguous())
            or q.shape[1] % k_pages.shape[2] or k_pages.shape[1] & (k_pages.shape[1] - 1)):
        return None
    lib = _library_for(q.dtype)
    if lib is None:
        return None
    T, H, D = q.shape
    B, H_kv, page_size = context_lens.shape[0], k_pages.shape[2], k_pages.shape[1]
    q = q.contiguous()
    cu, contexts, table = (_int32(t) for t in (cu_seqlens_q, context_lens, block_table))
    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    block = max(1, QUERY_ROWS // (H // H_kv))  # queries per work item: about QUERY_ROWS rows share a key tile
    failed = lib.tritonq_paged_attention(omp_parallel(), torch.get_num_threads(), DTYPES[q.dtype], q.data_ptr(),
                                         k_pages.data_ptr(), v_pages.data_ptr(), table.data_ptr(), table.shape[1],
                                         cu.data_ptr(), contexts.data_ptr(), B, H, H_kv, D, page_size, window, scale,
                                         out.data_ptr(), block)
    if failed:
        raise MemoryError("CPU attention: no memory for the kernel's scratch (a few KB)")
    return out


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, cache_lens: torch.Tensor,
                     block_table: torch.Tensor, scale: float, window: int) -> torch.Tensor | None:
    """q [B, H, D] -> [B, H, D]: query b at position cache_lens[b] - 1 over its keys (paged_attention with one query
    per sequence); None where paged_attention does not take the call."""
    return paged_attention(q, k_pages, v_pages, _one_query_each(q.shape[0]), cache_lens, block_table, scale, window)


@functools.lru_cache(maxsize=1024)
def _one_query_each(B: int) -> torch.Tensor:
    """cu_seqlens_q of B sequences of one query, int32 [B + 1] (0 .. B): made once per batch size, as each layer of a
    decode step asks for it; the kernel only reads it."""
    return torch.arange(B + 1, dtype=torch.int32)


def greedy_rows(logits: torch.Tensor) -> tuple[list[int], list[float]] | None:
    """logits [R, V] float32 on the CPU -> (tokens, logprobs): each row's first index of its largest logit and that
    token's log-probability under the row's softmax; token -1 for a row holding NaN or inf. None when the kernels
    are not built or the tensor is not one this takes (another dtype or device, rows not contiguous)."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or not logits.shape[1]
            or logits.stride(1) != 1):
        return None
    lib = _library_for(torch.float32)
    if lib is None:
        return None
    R, V = logits.shape
    tokens, logprobs = np.empty(R, dtype=np.int64), np.empty(R, dtype=np.float64)
    lib.tritonq_greedy_rows(logits.data_ptr(), R, V, logits.stride(0), tokens.ctypes.data, logprobs.ctypes.data)
    return tokens.tolist(), logprobs.tolist()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm of x [..., D] (fp32 / bf16 / fp16 on the CPU) with weight [D] of x's dtype, as
    norm_rope.rms_norm_reference computes it (statistics in float32, the normalised rows rounded, then times the
    weight in x's dtype). With add (x's shape and dtype): (x + add, RMSNorm of it), the sum rounded to the dtype as
    torch's addition rounds it, in one pass. None when the kernels are not built or the call is not one this
    takes."""
    if (not x.is_cpu or weight.dtype != x.dtype or weight.dim() != 1 or weight.shape[0] != x.shape[-1]
            or not x.shape[-1] or (add is not None and (add.shape != x.shape or add.dtype != x.dtype
                                                         or not add.is_cpu))):
        return None
    lib = _library_for(x.dtype)
    if lib is None:
        return None
    D = x.shape[-1]
    rows = _rows(x)
    weight = weight.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype)  # contiguous: rows of D
    if add is None:
        lib.tritonq_rms_norm(DTYPES[x.dtype], rows.data_ptr(), None, rows.shape[0], D, rows.stride(0), 0,
                             weight.data_ptr(), eps, None, y.data_ptr())
        return y
    other = _rows(add)
    total = torch.empty(x.shape, dtype=x.dtype)
    lib.tritonq_rms_norm(DTYPES[x.dtype], rows.data_ptr(), other.data_ptr(), rows.shape[0], D, rows.stride(0),
                         other.stride(0), weight.data_ptr(), eps, total.data_ptr(), y.data_ptr())
    return total, y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's product of gate_up [..., 2I] (fp32 / bf16 / fp16 on the CPU, gate the first I values of each row, up
    the rest): silu(gate) * up [..., I], as F.silu(gate) * up rounds it (silu rounded to the dtype, then the product):
    one pass instead of a split and two ops. None when the kernels are not built or the call is not one this takes
    (rows not contiguous, an odd last dim)."""
    if not gate_up.is_cpu or gate_up.shape[-1] % 2 or gate_up.stride(-1) != 1:
        return None
    lib = _library_for(gate_up.dtype)
    if lib is None:
        return None
    rows = _rows(gate_up)
    inter = rows.shape[1] // 2
    y = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype)
    lib.tritonq_silu_mul(DTYPES[gate_up.dtype], rows.data_ptr(), rows.shape[0], inter, rows.stride(0), y.data_ptr())
    return y


SMALL_COLS = 64  # csrc/linear.c's column block: small_linear's weight is padded to a multiple of it


def small_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] (fp32 / bf16 / fp16) in small_linear's layout: [K, Np] contiguous, k-major, of its dtype, Np = N
    rounded up to SMALL_COLS with zero columns."""
    N, K = weight.shape
    padded = torch.zeros(K, -(-N // SMALL_COLS) * SMALL_COLS, dtype=weight.dtype)
    padded[:, :N] = weight.t()
    return padded


def small_linear(x: torch.Tensor, weight: torch.Tensor, N: int, bias: torch.Tensor | None,
                 parallel: bool = False) -> torch.Tensor | None:
    """y [M, N] = x [M, K] @ W^T (+ bias float32 [N]) in x's dtype, W in small_linear_weight's layout and dtype;
    float32 sums in k order, rounded once (the same values as F.linear up to the order of the sum). Each row's
    result is the same whatever the other rows: made for a few rows of a small weight, where oneDNN's per-call cost
    is most of the time, and for every linear of the batch-invariant mode (kernels/cpu/dense.py). parallel: the
    blocks of rows and columns are shared by torch's OpenMP threads (the values do not change). None when the kernels
    are not built or x is not rows of the weight's dtype with a contiguous last dim."""
    if (x.dtype != weight.dtype or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != weight.shape[0]
            or not x.is_cpu):
        return None
    lib = _library_for(x.dtype)
    if lib is None:
        return None
    y = torch.empty(x.shape[0], N, dtype=x.dtype)
    lib.tritonq_small_linear(omp_parallel() if parallel else None, torch.get_num_threads(), DTYPES[x.dtype],
                             x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), weight.data_ptr(), N, weight.shape[1],
                             None if bias is None else bias.data_ptr(), y.data_ptr())
    return y


INT8_COLS = 64  # csrc/linear.c's column block of int8_linear's weight


def int8_linear_weight(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [K, N] and scales [G, N] (any float dtype; group = K / G rows of k each) in int8_linear's layout:
    (codes int8 [Np / INT8_COLS, K, INT8_COLS], scales float32 [Np / INT8_COLS, G, INT8_COLS]), Np = N rounded up
    to INT8_COLS with zero columns: each block of columns one contiguous stream."""
    (K, N), G = codes.shape, scales.shape[0]
    blocks = -(-N // INT8_COLS)
    blocked = torch.zeros(K, blocks * INT8_COLS, dtype=torch.int8)
    blocked[:, :N] = codes
    padded = torch.zeros(G, blocks * INT8_COLS)
    padded[:, :N] = scales
    return (blocked.view(K, blocks, INT8_COLS).transpose(0, 1).contiguous(),
            padded.view(G, blocks, INT8_COLS).transpose(0, 1).contiguous())


def int8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, N: int, bias: torch.Tensor | None,
                parallel: bool = False) -> torch.Tensor | None:
    """y [M, N] float32 = x [M, K] float32 @ W^T (+ bias float32 [N]), W[n, k] = code * scale in float32, codes and
    scales in int8_linear_weight's layout; float32 sums in k order, each row's result the same whatever the other
    rows (symmetric 8-bit weights kept as codes: kernels/cpu/lowbit.py). parallel: the blocks of rows and columns
    are shared by torch's OpenMP threads (the values do not change). None when the kernels are not built or x is not
    float32 rows of K with a contiguous last dim."""
    K = codes.shape[1]
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != K or not x.is_cpu:
        return None
    lib = _library_for(x.dtype)
    if lib is None:
        return None
    y = torch.empty(x.shape[0], N)
    lib.tritonq_int8_linear(omp_parallel() if parallel else None, torch.get_num_threads(), x.data_ptr(), x.shape[0],
                            K, x.stride(0), codes.data_ptr(), scales.data_ptr(), K // scales.shape[1], N,
                            None if bias is None else bias.data_ptr(), y.data_ptr())
    return y


def gguf_linear(x: torch.Tensor, w, parallel: bool = False) -> torch.Tensor | None:
    """y [M, N] float32 = x [M, K] float32 @ W^T (+ bias) for w a GGUFWeight (tritonq.quant.weights: one format's
    planes, 2-D, contiguous, on the CPU) read as stored: each weight's float32 value (the gguf package's) made in
    registers, float32 sums in k order, each row's result the same whatever the other rows. parallel: the blocks of
    rows and columns are shared by torch's OpenMP threads (the values do not change). None when the kernels are not
    built or x is not float32 rows of K with a contiguous last dim."""
    N, K = w.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] != K or not x.is_cpu:
        return None
    planes = {name: getattr(w, name) for name in ("lo", "hi", "scales", "offsets", "code")}
    for name, t in planes.items():
        if t is not None and (not t.is_contiguous() or not t.is_cpu
                              or t.dtype != (torch.int32 if name in ("lo", "hi") else torch.float32)):
            raise ValueError(f"gguf_linear: the {w.type_name} weight's {name} is a {t.dtype} tensor on {t.device} "
                             f"with strides {t.stride()}, expected a contiguous CPU "
                             f"{'int32' if name in ('lo', 'hi') else 'float32'} one: load it through "
                             "tritonq.formats.gguf (its planes are made so)")
    lib = _library_for(x.dtype)
    if lib is None:
        return None
    y = torch.empty(x.shape[0], N)
    bias = None if w.bias is None else w.bias.float().contiguous()

    def ptr(t: torch.Tensor | None) -> int | None:
        return None if t is None else t.data_ptr()
    failed = lib.tritonq_gguf_linear(omp_parallel() if parallel else None, torch.get_num_threads(), x.data_ptr(),
                                     x.shape[0], K, x.stride(0), w.lo.data_ptr(), ptr(w.hi), w.bits, w.zero,
                                     ptr(w.code), w.scales.data_ptr(), ptr(w.offsets), w.group_size, N, ptr(bias),
                                     y.data_ptr())
    if failed:
        raise ValueError(f"gguf_linear: a {w.type_name} weight of {w.bits}-bit codes, group {w.group_size}, K = {K} "
                         f"(zero {w.zero}, offsets {w.offsets is not None}, code table {w.code is not None}) is outside what "
                         "the C kernel takes (4-6 bits, group 16 or 32, K a multiple of 32, zero 0 or a power of two "
                         "without offsets); repack it with tritonq.formats.gguf")
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [B, S, H, D] (fp32 / bf16 / fp16 on the CPU, D contiguous, even) rotated by cos / sin [B, S, D] of x's dtype,
    as norm_rope.apply_rope's torch ops compute it (x * cos rounded to the dtype, then + rotate_half(x) * sin, rounded
    once): one pass instead of a multiply, a negation, a concatenation and an addcmul, each a dispatch and a tensor
    (4 x ~20 us a layer on a decode step of 256 rows here). A new contiguous tensor; None when the kernels are not
    built or the call is not one this takes."""
    B, S, H, D = x.shape
    if (not x.is_cpu or cos.dtype != x.dtype or sin.dtype != x.dtype or D % 2 or x.stride(3) != 1
            or x.stride(0) != S * x.stride(1)):
        return None
    lib = _library_for(x.dtype)
    if lib is None:
        return None
    cos, sin = cos.contiguous(), sin.contiguous()  # [B, S, D]: rows of D
    y = torch.empty(B, S, H, D, dtype=x.dtype)
    lib.tritonq_rope(DTYPES[x.dtype], x.data_ptr(), B * S, H, D, x.stride(1), x.stride(2), cos.data_ptr(),
                     sin.data_ptr(), y.data_ptr())
    return y


def _token_rows_contiguous(x: torch.Tensor) -> bool:
    """Whether each token's [Hkv, D] of x [T, Hkv, D] is contiguous (x[0].is_contiguous() without making the view)."""
    return (x.shape[2] == 1 or x.stride(2) == 1) and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Token t's k [T, Hkv, Dqk] / v [T, Hkv, Dv] into row slot_mapping[t] of the pages [P, page_size, Hkv, D*] seen
    as rows, in place, skipping slots < 0: one loop of row copies instead of a check of the slots, a host sync and
    two index_copy_ (5 dispatches a layer). Raises IndexError (writing nothing) for a slot past the pages. False
    (nothing written) when the kernels are not built or the call is not one this takes (dtypes that differ, pages
    not contiguous, a token's rows not contiguous)."""
    T = k.shape[0]
    if (not k.is_cpu or k.dim() != 3 or v.dim() != 3 or k_pages.dim() != 4 or v_pages.dim() != 4
            or k.dtype != k_pages.dtype or v.dtype != v_pages.dtype or v.shape[0] != T or slot_mapping.shape != (T,)
            or k.shape[1:] != k_pages.shape[2:] or v.shape[1:] != v_pages.shape[2:]
            or not (k_pages.is_contiguous() and v_pages.is_contiguous())
            or not all(_token_rows_contiguous(x) for x in (k, v))):
        return False
    lib = library()
    if lib is None:
        return False
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    slots = slots.contiguous()
    size = k.element_size()
    failed = lib.tritonq_write_kv(k_pages.data_ptr(), v_pages.data_ptr(), k.data_ptr(), v.data_ptr(),
                                  slots.data_ptr(), T, k_pages.shape[0] * k_pages.shape[1],
                                  k_pages.shape[2] * k_pages.shape[3] * size, v_pages.shape[2] * v_pages.shape[3] * v.element_size(),
                                  k.stride(0) * size, v.stride(0) * v.element_size())
    if failed:
        raise IndexError(f"write_kv_slots: a slot in slot_mapping is past the {k_pages.shape[0] * k_pages.shape[1]} "
                         "page rows")
    return True
