"""The decode attention kernels' memory instructions on sm_80 (A100) and sm_90 (H100/H200), read from the SASS of
their AOT-compiled default launches (kernels/aot.py `global_memory_ops`, no GPU): K/V tiles of 16-bit pages come in
16-byte cp.async loads (LDGSTS.E.BYPASS.128), 8-bit pages in loads of at least 8 bytes, and nothing touches local
memory (no spills, no stack arrays). Launches: Llama-3-8B's 32 / 8 heads of 128 over 16-token pages at batch 1
(KV split across the SMs, then the merge) and 256 (one split, the merge folded in), int8 / fp8 pages, DeepSeek's
absorbed-MLA latent 576 / 512. The compiles run in a child process (conftest's TRITON_INTERPRET=1 makes the kernels
interpreted functions, which do not compile).
"""
import os

import pytest
from child_process import Child, last_json

TARGETS = (80, 90)
CASES = ["batch1 bf16", "batch256 bf16", "batch1 int8", "batch1 fp8", "batch256 fp8", "mla bf16"]


def memory_ops() -> dict:
    """{"cc case": {opcode: count}} for every target and case (run in the child)."""
    import torch

    from tritonq.kernels import attention
    from tritonq.kernels.aot import SM_COUNT, global_memory_ops

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    def pages(kind, heads=8, dim=128):
        if kind == "bf16":
            return meta(4096, 16, heads, dim)
        if kind == "int8":
            return attention.QuantizedPages(meta(4096, 16, heads, dim, dtype=torch.int8),
                                            meta(4096, 16, heads, dtype=torch.float32))
        return attention.QuantizedPages(meta(4096, 16, heads, dim, dtype=torch.float8_e4m3fn),
                                        meta(dtype=torch.float32))

    out = {}
    for cc in TARGETS:
        for case in CASES:
            shape, kind = case.split()
            if shape == "mla":
                h, h_kv, d_qk, d_v, batch = 16, 1, 576, 512, 1
                k = pages(kind, 1, 576)
                v = k[..., :512]
            else:
                h, h_kv, d_qk, d_v, batch = 32, 8, 128, 128, int(shape.removeprefix("batch"))
                k = v = pages(kind)
            config = attention.decode_config(batch, h_kv, 32768, 16, *attention.head_blocks(d_qk, d_v), SM_COUNT[cc])
            split, merge, _ = attention.decode_launches(meta(batch, h, d_qk), k, v, meta(batch, dtype=torch.int32),
                                                        meta(batch, 2048, dtype=torch.int32), d_qk ** -0.5, 0, config)
            out[f"{cc} {case}"] = dict(global_memory_ops(split, cc), splits=config.NUM_SPLITS)
    return out


_CHILD = Child(["-c", "import json, test_attention_sass as t; print(json.dumps(t.memory_ops()))"],
               first_on_path=(os.path.dirname(__file__),))


def background_children(items) -> list[Child]:
    """The compiles, run niced by tests/conftest.py once the session is collected (these tests run last)."""
    return [_CHILD]


@pytest.fixture(scope="module")
def ops():
    return last_json(_CHILD.stdout(timeout=600))


@pytest.mark.parametrize("cc", TARGETS)
@pytest.mark.parametrize("case", CASES)
def test_decode_loads_kv_in_wide_vectors_and_never_spills(ops, cc, case):
    found = ops[f"{cc} {case}"]
    splits = found.pop("splits")
    assert (splits == 1) == case.startswith("batch256"), splits  # 256 x 8 programs fill the GPU: one split
    assert not {op for op in found if op.startswith(("LDL", "STL"))}, f"local memory: {found}"
    tile_loads = {op: n for op, n in found.items() if op.startswith("LDGSTS")}  # cp.async: the K/V tiles
    assert tile_loads, f"no cp.async tile loads: {found}"
    if case.endswith("bf16") and not case.startswith("mla"):
        assert set(tile_loads) == {"LDGSTS.E.BYPASS.128"}, found
    elif case.startswith("mla"):  # the 512 + 64 latent: its 512-wide part in 16 bytes
        assert tile_loads.get("LDGSTS.E.BYPASS.128", 0) >= 8, found
    else:  # 8-bit pages: 8-byte K/V loads (the 4-byte ones: int8 per-key fp32 scales, Hkv apart in memory)
        assert tile_loads.get("LDGSTS.E.64", 0) + tile_loads.get("LDGSTS.E.BYPASS.128", 0) >= 4, found
