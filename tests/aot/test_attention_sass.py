"""The attention kernels' memory instructions on sm_80 (A100) and sm_90 (H100/H200), read from the SASS of their
AOT-compiled default launches (kernels/aot.py `global_memory_ops`, no GPU): K/V tiles come in 16-byte cp.async loads
(LDGSTS.E.BYPASS.128), at decode 8-bit pages too (their V tiles read as byte pairs, jit._attend_tile; the only
narrower cp.async are int8's per-key fp32 scales; prefill's 8-bit V tiles are byte pairs before sm_90 and come in 8
bytes on sm_90), and nothing
touches local memory (no spills, no stack arrays). Launches:
decode of Llama-3-8B's 32 / 8 heads of 128 over 16-token pages at batch 1 (KV split across the SMs, then the merge)
and 256 (one split, the merge folded in), int8 / fp8 pages, DeepSeek's absorbed-MLA latent 576 / 512 (bf16 and
int8 pages); paged prefill over int8 / fp8 pages. The compiles run in a child process (conftest's
TRITON_INTERPRET=1 makes the kernels interpreted functions, which do not compile).
"""
import os

import pytest
from child_process import json_from_child

TARGETS = (80, 90)
CASES = ["batch1 bf16", "batch256 bf16", "batch1 int8", "batch1 fp8", "batch256 fp8", "mla bf16", "mla int8",
         "prefill int8", "prefill fp8"]


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
            if shape == "prefill":  # 2048 new tokens of 4 sequences, Llama-3-8B's heads
                k = pages(kind)
                i32 = dict(dtype=torch.int32)
                config = attention.paged_prefill_config(*attention.head_blocks(128, 128), cc)
                launch = attention.paged_prefill_launch(meta(2048, 32, 128), k, k, meta(5, **i32), meta(4, **i32),
                                                        meta(4, 256, **i32), 128 ** -0.5, 0, config)[0]
                out[f"{cc} {case}"] = dict(global_memory_ops(launch, cc), splits=0)
                continue
            if shape == "mla":
                h, h_kv, d_qk, d_v, batch = 16, 1, 576, 512, 1
                k = pages(kind, 1, 576)
                v = k[..., :512] if kind == "bf16" else attention.QuantizedPages(k.data[..., :512], k.scale)
            else:
                h, h_kv, d_qk, d_v, batch = 32, 8, 128, 128, int(shape.removeprefix("batch"))
                k = v = pages(kind)
            config = attention.decode_config(batch, h_kv, 32768, 16, *attention.head_blocks(d_qk, d_v), SM_COUNT[cc])
            split, merge, _ = attention.decode_launches(meta(batch, h, d_qk), k, v, meta(batch, dtype=torch.int32),
                                                        meta(batch, 2048, dtype=torch.int32), d_qk ** -0.5, 0, config)
            out[f"{cc} {case}"] = dict(global_memory_ops(split, cc), splits=config.NUM_SPLITS)
    return out


@pytest.fixture(scope="module")
def ops():
    return json_from_child(["-c", "import json, test_attention_sass as t; print(json.dumps(t.memory_ops()))"], first_on_path=(os.path.dirname(__file__),))


@pytest.mark.parametrize("cc", TARGETS)
@pytest.mark.parametrize("case", CASES)
def test_decode_loads_kv_in_wide_vectors_and_never_spills(ops, cc, case):
    found = ops[f"{cc} {case}"]
    splits = found.pop("splits")
    if not case.startswith("prefill"):  # 256 x 8 programs fill the GPU: one split
        assert (splits == 1) == case.startswith("batch256"), splits
    assert not {op for op in found if op.startswith(("LDL", "STL"))}, f"local memory: {found}"
    tile_loads = {op: n for op, n in found.items() if op.startswith("LDGSTS")}  # cp.async: the K/V tiles
    assert tile_loads, f"no cp.async tile loads: {found}"
    if case.startswith("mla"):  # the 512 + 64 latent: its 512-wide part in 16 bytes (8-bit: all of it)
        assert tile_loads.get("LDGSTS.E.BYPASS.128", 0) >= 8, found
        assert case.endswith("bf16") or "LDGSTS.E.64" not in tile_loads, found
    elif case.startswith("prefill"):  # K in 16 bytes; V too on sm_80 (byte pairs, PrefillConfig.v_pairs)
        assert tile_loads.get("LDGSTS.E.BYPASS.128", 0) >= 2, found
        narrow = {"LDGSTS.E.64"} if cc >= 90 else set()  # sm_90's byte tiles (its wgmma reads 16 bytes anyway)
        assert set(tile_loads) <= {"LDGSTS.E.BYPASS.128", "LDGSTS.E", *narrow}, found
    elif case.endswith("bf16"):
        assert set(tile_loads) == {"LDGSTS.E.BYPASS.128"}, found
    else:  # 8-bit decode: K and V in 16 bytes too; 4-byte loads only for int8's per-key fp32 scales (Hkv apart)
        assert tile_loads.get("LDGSTS.E.BYPASS.128", 0) >= 4, found
        assert set(tile_loads) <= {"LDGSTS.E.BYPASS.128", "LDGSTS.E" if case.endswith("int8") else ""}, found
