"""AOT compile of the int4 kernels for GPUs we do not have (T4 sm_75, A100 sm_80, H100/H200 sm_90).

Compiles the launcher's own launch (its builder over meta tensors: signature, strides and
divisibility hints as at run time) for the GEMV/split-K (decode) and tiled GEMM default configs
through the whole NVIDIA pipeline with the bundled ptxas and checks what the interpreter cannot: the kernel lowers for
each target, shared memory fits the target's limit, and on sm_90 the M >= 64 tiles use wgmma.
Run with -s to see the table (shared bytes, registers, spills, wgmma) per config. The compiles
run once, in a subprocess without TRITON_INTERPRET (under it @triton.jit gives interpreted
functions that cannot be compiled), and report back as JSON.
"""
import dataclasses
import json

import pytest
import torch
from child_process import json_from_child

from tritonq.kernels.aot import SHARED_MEMORY_LIMIT, compile_launch
from tritonq.kernels.int4_gemm import aot_launch, default_config

# (name, M, config): the defaults int4_gemm picks for a 4096 x 4096 layer at decode and prefill M.
CONFIGS = {"gemv-splitk M<=16": (1, default_config(1, 4096, 4096)),
           "gemm M<=64": (64, default_config(64, 4096, 4096)),
           "gemm M>64": (256, default_config(256, 4096, 4096))}
# The weights of the variants (group 128): AWQ/GPTQ asymmetric fp16 everywhere; on sm_90 also
# symmetric act-order bf16 (the per-row gather path) and GPTQ 8-bit.
VARIANTS = {"fp16-asym": dict(dtype=torch.float16, bits=4, zeros=True, act_order=False),
            "bf16-sym-g_idx": dict(dtype=torch.bfloat16, bits=4, zeros=False, act_order=True),
            "fp16-8bit-asym": dict(dtype=torch.float16, bits=8, zeros=True, act_order=False)}
CASES = ([(cc, name, "fp16-asym") for cc in (75, 80, 90) for name in CONFIGS]
         + [(90, name, variant) for name in ("gemv-splitk M<=16", "gemm M>64")
            for variant in ("bf16-sym-g_idx", "fp16-8bit-asym")])


def compile_int4(name, variant, cc):
    """The launcher's own launch (int4_gemm.aot_launch: its builder over meta tensors), compiled."""
    M, config = CONFIGS[name]
    return compile_launch(aot_launch(config, M, 4096, 4096, **VARIANTS[variant]), cc)


@pytest.fixture(scope="module")
def reports():
    return {tuple(case): report for case, report in json_from_child([__file__])}


@pytest.mark.parametrize("cc, name, variant", CASES,
                         ids=[f"sm{c}-{n.split()[0]}{n.split()[1]}-{v}" for c, n, v in CASES])
def test_int4_kernel_compiles_within_shared_memory(reports, cc, name, variant):
    (_, config), report = CONFIGS[name], reports[(cc, name, variant)]
    print(f"\nsm_{cc} {name:18s} {variant:15s} {config.BLOCK_M}x{config.BLOCK_N}x{config.BLOCK_K} "
          f"split{config.SPLIT_K} w{config.num_warps} s{config.num_stages}: shared {report['shared_bytes']} B "
          f"(limit {SHARED_MEMORY_LIMIT[cc]}), registers {report['registers']}, spills {report['spills']} B, "
          f"wgmma {report['uses_wgmma']}")
    assert report["shared_bytes"] <= SHARED_MEMORY_LIMIT[cc]
    if cc == 90 and config.BLOCK_M >= 64:
        assert report["uses_wgmma"], "sm_90 fell back from wgmma to mma for a 64-row tile"


if __name__ == "__main__":  # the subprocess: compile every case, print [[case, report], ...]
    print(json.dumps([[case, dataclasses.asdict(compile_int4(case[1], case[2], case[0]))]
                      for case in CASES]))
