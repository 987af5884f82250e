"""The decode linears' main loops, read from their SASS: what each weight costs in instructions, without a GPU.

Each weight type's M = 1 launch (the launcher's own builder over meta tensors, default config; a 4096 x 4096
layer), GGUF's Q4_K / Q5_K / Q6_K / IQ4_XS GEMM's, and the fused MoE's int4 gate/up GEMM at the decode tile the runtime
picks for one token (the same dequantization helper; DeepSeek-V2-Lite's experts), its MXFP4 one (gpt-oss-20b's
experts) and its GGUF Q4_K one (Qwen3-30B-A3B's experts, kernels/gguf_gemm.py's expert kernel), is compiled
ahead of time for sm_80 and sm_90 (kernels/aot.py, Triton's bundled ptxas) and its main loop (the longest backward
branch of the SASS, Triton's bundled cuobjdump) must show:
  * no int-to-float conversion (I2F*): the codes become floats by magic numbers (common.dequantize_int_tile).
    I2F.RP is not one: it seeds the reciprocal of an integer division by a run-time divisor;
  * the weight codes in 16-byte loads (LDG.E.128 / cp.async LDGSTS.*.128): enough of them for the tile;
  * no local memory anywhere in the kernel (LDL / STL: spills);
  * at most ALU_PER_WEIGHT arithmetic instructions per weight (one thread's loop body over the weights it
    dequantizes per iteration). The bounds are the figures measured with Triton 3.9 plus ~5% (a regression
    fails). Issue 50's target is ~2.5: the int4 AWQ / GPTQ loops reach it (common.int4_words_to_magic's PTX:
    per two codes one prmt, one lop3 and one half2 subtraction, the scale on the dot's result), act-order
    too (sorted by group once, x read through the permutation: int4_gemm.sort_act_order); 8-bit in fp16 is
    below it (one prmt per two codes), in bf16 above (per two codes a prmt, two lop3 and a packed add: the low 7
    bits and the top bit as exact bf16 pieces); nf4 looks its codes up by pairs (common.code_pairs_lookup: a
    tl.gather from the table in shared memory, a prmt a byte for the index); GGUF's formats put their groups side by
    side in the rows of one dot (kernels/gguf_gemm.py's decode word path: int4's PTX, with Q5 / Q6_K's high bits
    merged per word, IQ4 by pairs); fp8 x fp8 (sm_90) and W8A8 quantize only the
    M bucket's rows of x per K tile (common.broadcast_rows) over 128 columns; fp8 weight-only (sm_80) decodes 4
    e4m3 bytes a word (common.e4m3_words_to_halves: per two codes a sign-replicating prmt, a shift and an and, in
    bf16 a packed FMA); W8A8 loads whole K tiles unmasked along K (common.k_tile_mask) (docs/gpu_kernels.md has
    the before / after mix and what is left).
The prefill launches (M = 256) of int4, int8, fp8-block and W8A8, and the MoE MXFP4 gate/up GEMM at 64 tokens per
expert, must issue their tensor-core instruction in the main loop (sm_90: wgmma, HGMMA / QGMMA / IGMMA; sm_80:
HMMA / IMMA), load their weight tiles by 16-byte cp.async over >= 3 pipeline stages and not spill.
The compiles run in one child process (conftest's TRITON_INTERPRET=1 makes @triton.jit functions
uncompilable), over a process pool; `python tests/aot/test_sass.py` prints the JSON report.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tritonq.bench.model import WEIGHT_TYPES, weight_launch, weights_per_iteration

try:
    from child_process import json_from_child
except ImportError:  # run as a script by the child itself
    from tests.child_process import json_from_child

N = K = 4096
MOE_PROBLEM = (512, 64, 6, 2048, 1408, 0)  # tokens, experts, top-k, D, I, gate/up (tests/aot/test_fit.py's)
GPT_OSS_MOE_PROBLEM = (512, 32, 4, 2880, 2880, 0)  # gpt-oss-20b's MXFP4 experts (biases, clamped SwiGLU)
GGUF_MOE_PROBLEM = (1, 128, 8, 2048, 768)  # one token over Qwen3-30B-A3B's experts (a Q4_K_M file's Q4_K gate/up)
CODE_BYTES = {"moe-int4": 0.5, "moe-mxfp4": 0.5, "moe-gguf-q4_k": 0.5,
              "int4-awq": 0.5, "int4-gptq": 0.5, "int4-act-order": 0.5, "nf4": 0.5, "int8-gptq": 1,
              "fp8-block": 1, "w8a8": 1, "gguf-q4_k": 0.5, "gguf-q5_k": 0.625, "gguf-q6_k": 0.75, "gguf-iq4_xs": 0.5}
GGUF_KINDS = {"gguf-q4_k": dict(bits=4, group=32, offsets=True), "gguf-q5_k": dict(bits=5, group=32, offsets=True),
              "gguf-q6_k": dict(bits=6, group=16, offsets=False),
              "gguf-iq4_xs": dict(bits=4, group=32, offsets=False, code=True)}
# {(cc, weight type): ALU instructions per weight}: measured (Triton 3.9, bf16; fp16 is at or below, or has its own
# (cc, "float16", weight type) entry) + ~5% (int4, int8, nf4, the MoE's, fp8, w8a8) or ~10%. sm_80's fp8-block is the
# weight-only path (e4m3 words decoded by PTX: 8.45 with the byte decode before, 3.49 with an and, a shr and a lop3 per
# two codes), sm_90's an e4m3 x e4m3 dot; w8a8 an int8 dot. sm_90's fp8-block and both w8a8
# quantize x inside the loop at decode (one launch, no quantization kernel first): 8.9 and 6.0 per weight while that
# quantized the dot's 16 padded rows (in every warp's operand layout), 2.1 and 0.7 for the M bucket's rows (W8A8 0.6
# without masks along K). int8-gptq in bf16: 3.35-3.37 through fp32 (a prmt and an FADD per code), 2.71 in two
# exact bf16 pieces. int4_gemm's loops (int4, int8, nf4) load without K masks where K is whole tiles (EVEN_K: 0.1-0.2 fewer per weight).
ALU_PER_WEIGHT = {
    (80, "int4-awq"): 2.45, (80, "int4-gptq"): 2.35, (80, "int4-act-order"): 2.65, (80, "int8-gptq"): 2.85,
    (80, "nf4"): 1.85, (80, "fp8-block"): 3.15, (80, "w8a8"): 0.59,
    (90, "int4-awq"): 2.45, (90, "int4-gptq"): 2.35, (90, "int4-act-order"): 2.85, (90, "int8-gptq"): 2.85,
    (90, "nf4"): 2.3, (90, "fp8-block"): 2.2, (90, "w8a8"): 0.62,
    # the MoE's gate/up decode loops (moe.WORD_DECODE_CONFIG, 16 x 64 x 128: whole K tiles unmasked, expert bases
    # once, int4's scale row on the dot's result; MXFP4 by common.mxfp4_words_to_half: prmt byte lookups from
    # immediate tables, one packed multiply per two codes, the dequantized tile through shared memory as int4's):
    # int4 2.46 / 2.48 (sm_90 / sm_80; 3.47 at 16 x 64 x 64 with the scale per weight, 3.8 before group size became
    # a constexpr), MXFP4 2.66 / 2.62 (3.55 / 3.45 while Triton kept its weights in registers, taking them for an
    # upcast of the 8-bit scales: common.OPAQUE_COPY_PTX; 5.16 / 5.28 with two multiplies and per-iteration masks,
    # 12.0 with integer decode and fp32 scaling); fp16 2.93 / 2.90 (one more lop3 per four codes; 3.9-4.1 before)
    (80, "moe-int4"): 2.6, (90, "moe-int4"): 2.6, (80, "moe-mxfp4"): 2.75, (90, "moe-mxfp4"): 2.8,
    (80, "float16", "moe-mxfp4"): 3.05, (90, "float16", "moe-mxfp4"): 3.1,
    # GGUF Q4_K experts' gate/up at one token (gguf_gemm's decode word path over experts: a row block per routed
    # expert, the K tile's 16 groups in the dot's 16 rows, 32 gate and their 32 up columns in one dot, scale and offset
    # on its fp32 result): 2.20 / 2.57 (sm_80 / sm_90); 7.19 / 6.64 with each weight formed in fp32 (16-row blocks)
    (80, "moe-gguf-q4_k"): 2.3, (90, "moe-gguf-q4_k"): 2.7,
    # GGUF block formats (kernels/gguf_gemm.py), the decode word path: a dot whose 16 rows hold the K tile's groups,
    # scale, zero and offset on its fp32 result (sm_80 / sm_90). Q4_K: int4_words_to_magic's PTX, 2.20 / 2.56; Q5_K
    # and Q6_K: the high plane's bits merged into the nibbles' bytes (common.high_words_to_magic), 3.16 / 3.59 (one
    # stage) and 3.52 / 3.77 (groups of 16: twice the affine); IQ4_XS: the levels by pairs (common.code_pairs_lookup,
    # one stage, nf4's table in shared memory), 1.37 / 2.36. With each weight formed in fp32 before: Q4_K 6.84 / 6.30, Q5_K 9.86 / 9.95, Q6_K
    # 10.09 / 10.20, IQ4_XS 6.14 / 6.12
    (80, "gguf-q4_k"): 2.3, (90, "gguf-q4_k"): 2.7, (80, "gguf-q5_k"): 3.3, (90, "gguf-q5_k"): 3.75,
    (80, "gguf-q6_k"): 3.7, (90, "gguf-q6_k"): 3.95, (80, "gguf-iq4_xs"): 1.45, (90, "gguf-iq4_xs"): 2.5,
}
CASES = [(cc, "bfloat16", kind) for cc in (80, 90)
         for kind in (*WEIGHT_TYPES, "moe-int4", "moe-mxfp4", "moe-gguf-q4_k", *GGUF_KINDS)] + [
    (cc, "float16", kind) for cc in (80, 90) for kind in ("int4-awq", "int8-gptq", "fp8-block", "moe-mxfp4")]


def _mix(case) -> dict:
    """One case's loop summary (run in the child's pool workers)."""
    from tritonq.kernels.aot import loop_mix

    from tritonq.kernels import gguf_gemm, moe

    cc, dtype, kind = case
    if kind == "moe-int4":  # gate/up at the decode tile the runtime picks (1 token): two weight tiles per iteration
        tokens, experts, top_k = MOE_PROBLEM[:3]
        config = moe.default_config(1, top_k, experts, words=True)
        launch = moe.aot_launch(config, MOE_PROBLEM, "int4", dtype=getattr(torch, dtype), cc=cc)
        per_thread = 2 * weights_per_iteration(launch) / (32 * launch.num_warps)
    elif kind == "moe-mxfp4":  # gpt-oss's gate/up, likewise
        tokens, experts, top_k = GPT_OSS_MOE_PROBLEM[:3]
        config = moe.default_config(1, top_k, experts, words=True)
        launch = moe.aot_launch(config, GPT_OSS_MOE_PROBLEM, "mxfp4", dtype=getattr(torch, dtype), gpt_oss=True,
                                cc=cc)
        per_thread = 2 * weights_per_iteration(launch) / (32 * launch.num_warps)
    elif kind == "moe-gguf-q4_k":  # gate and up columns in one dot: BLOCK_N counts both
        config = moe.default_config(1, GGUF_MOE_PROBLEM[2], GGUF_MOE_PROBLEM[1], diagonal=True)
        launch = gguf_gemm.aot_moe_launch(config, GGUF_MOE_PROBLEM, True, 4, 32, True, getattr(torch, dtype), cc=cc)
        per_thread = weights_per_iteration(launch) / (32 * launch.num_warps)
    elif kind in GGUF_KINDS:
        launch = gguf_gemm.aot_launch(None, 1, N, K, dtype=getattr(torch, dtype), cc=cc, **GGUF_KINDS[kind])
        per_thread = weights_per_iteration(launch) / (32 * launch.num_warps)
    else:
        launch = weight_launch(kind, 1, N, K, cc, getattr(torch, dtype))
        per_thread = weights_per_iteration(launch) / (32 * launch.num_warps)
    mix = loop_mix(launch, cc)
    wide = sum(n for op, n in mix.loop.items() if op.startswith(("LDG.", "LDGSTS.")) and op.endswith(".128"))
    i2f = sum(n for op, n in mix.loop.items() if op.startswith("I2F") and ".RP" not in op)
    return dict(loop=mix.loop, alu_per_weight=mix.alu / per_thread, weights_per_thread=per_thread, i2f=i2f,
                wide_loads=wide, local_memory=mix.local_memory)


# Prefill (M = 256): the tensor-core instruction each weight type's main loop must issue. sm_90: warp-group MMAs
# (wgmma: HGMMA for bf16 operands, QGMMA for e4m3 x e4m3, IGMMA for int8 x int8; the dequantized int4 / int8 tile
# goes through shared memory, where wgmma reads its B operand); sm_80: mma.sync (HMMA, IMMA; fp8 weight-only).
PREFILL_M = 256
PREFILL_MMA = {(90, "int4-awq"): "HGMMA", (90, "int8-gptq"): "HGMMA", (90, "fp8-block"): "QGMMA",
               (90, "w8a8"): "IGMMA", (80, "int4-awq"): "HMMA", (80, "int8-gptq"): "HMMA", (80, "fp8-block"): "HMMA",
               (80, "w8a8"): "IMMA", (90, "moe-mxfp4"): "HGMMA", (80, "moe-mxfp4"): "HMMA"}
PREFILL_CASES = sorted(PREFILL_MMA)
# The MoE MXFP4 gate/up prefill loop (gpt-oss-20b's experts, 64 tokens per expert: the 64 x 64 x 64 tile) also keeps
# its ALU instructions per weight: measured (Triton 3.9) + ~5%; 26.5 on sm_80 (4.4 on sm_90) while its weights
# reached the dot in registers (common.OPAQUE_COPY_PTX).
PREFILL_ALU_PER_WEIGHT = {(80, "moe-mxfp4"): 3.85, (90, "moe-mxfp4"): 4.55}


def _prefill_mix(case) -> dict:
    from tritonq.kernels.aot import loop_mix

    from tritonq.kernels import moe

    cc, kind = case
    if kind == "moe-mxfp4":  # gate/up: two weight tiles per iteration
        problem = (GPT_OSS_MOE_PROBLEM[1] * 64 // GPT_OSS_MOE_PROBLEM[2], *GPT_OSS_MOE_PROBLEM[1:])
        config = moe.default_config(problem[0], problem[2], problem[1], words=True)
        launch = moe.aot_launch(config, problem, "mxfp4", dtype=torch.bfloat16, gpt_oss=True, cc=cc)
        per_thread = 2 * weights_per_iteration(launch) / (32 * launch.num_warps)
    else:
        launch = weight_launch(kind, PREFILL_M, N, K, cc, torch.bfloat16)
        per_thread = weights_per_iteration(launch) / (32 * launch.num_warps)
    mix = loop_mix(launch, cc)
    return dict(loop=mix.loop, local_memory=mix.local_memory, num_stages=launch.num_stages,
                alu_per_weight=mix.alu / per_thread,
                wide_loads=sum(n for op, n in mix.loop.items() if op.startswith("LDGSTS.") and op.endswith(".128")))


def compile_all() -> dict:
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                                mp_context=multiprocessing.get_context("fork")) as pool:
        decode = pool.map(_mix, CASES)
        prefill = pool.map(_prefill_mix, PREFILL_CASES)
        return {"reports": [[list(c), r] for c, r in zip(CASES, decode)],
                "prefill": [[list(c), r] for c, r in zip(PREFILL_CASES, prefill)]}


_REPORTS: dict = {}


def reports() -> dict:
    if not _REPORTS:
        result = json_from_child([__file__], timeout=1800)
        _REPORTS.update({tuple(case): report for case, report in result["reports"]})
        _REPORTS.update({("prefill", *case): report for case, report in result["prefill"]})
    return _REPORTS


@pytest.mark.parametrize("cc, dtype, kind", CASES, ids=[f"sm{c}-{d}-{k}" for c, d, k in CASES])
def test_decode_loop_sass_aot(cc, dtype, kind):
    report = reports()[(cc, dtype, kind)]
    print(f"\nsm_{cc} {dtype} {kind}: {report}")
    assert report["i2f"] == 0, f"int-to-float conversions in the main loop: {report['loop']}"
    code_bytes = report["weights_per_thread"] * CODE_BYTES[kind]
    assert 16 * report["wide_loads"] >= code_bytes, (
        f"{report['wide_loads']} 16-byte loads per iteration cannot carry {code_bytes:g} bytes of weight codes")
    assert report["local_memory"] == 0, "local memory (LDL/STL) in the kernel: registers spill"
    bound = ALU_PER_WEIGHT.get((cc, dtype, kind), ALU_PER_WEIGHT[(cc, kind)])  # a dtype's own bound, if it has one
    assert report["alu_per_weight"] <= bound, (
        f"{report['alu_per_weight']:.2f} ALU instructions per weight, bound {bound}")


@pytest.mark.parametrize("cc, kind", PREFILL_CASES, ids=[f"sm{c}-{k}" for c, k in PREFILL_CASES])
def test_prefill_loop_sass_aot(cc, kind):
    """M = 256: the main loop feeds the tensor cores (the dequantized tile once per K tile), its weight tiles
    arrive by pipelined 16-byte cp.async (num_stages >= 3) and nothing spills."""
    report = reports()[("prefill", cc, kind)]
    print(f"\nsm_{cc} {kind} M{PREFILL_M}: {report}")
    mma = PREFILL_MMA[(cc, kind)]
    assert any(op.split(".")[0] == mma for op in report["loop"]), f"no {mma} in the main loop: {report['loop']}"
    assert report["wide_loads"] > 0 and report["num_stages"] >= 3, (
        f"{report['wide_loads']} 16-byte cp.async per iteration, {report['num_stages']} stages")
    assert report["local_memory"] == 0, "local memory (LDL/STL) in the kernel: registers spill"
    if (cc, kind) in PREFILL_ALU_PER_WEIGHT:
        assert report["alu_per_weight"] <= PREFILL_ALU_PER_WEIGHT[(cc, kind)], (
            f"{report['alu_per_weight']:.2f} ALU instructions per weight, bound {PREFILL_ALU_PER_WEIGHT[(cc, kind)]}")


if __name__ == "__main__":  # the child: compile every case, print the JSON report on the last line
    sys.stdout.write(json.dumps(compile_all()) + "\n")
