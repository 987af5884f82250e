"""int4_gemm (Triton, via the interpreter) against int4_gemm_reference, and the reference against
a dense matrix unpacked by hand from raw AWQ / GPTQ tensors.

Tolerance, relative to max |reference|, one per activation dtype: both sides accumulate in fp32
over weights rounded to the same 16-bit dtype, so they differ by at most one rounding of the
output to x.dtype (eps of that dtype). fp32 x: the kernel keeps weights in fp32 while the
reference rounds them to the fp16 scales dtype, a relative 2^-11 per weight.
"""
import functools
from dataclasses import replace

import numpy as np
import pytest
import tolerances
import torch

from tritonq.formats.layers import Linear
from tritonq.formats.awq import awq_to_int4
from tritonq.formats.gptq import gptq_to_int4
from tritonq.kernels.int4_gemm import (
    CONFIG_SPACE,
    Int4GemmConfig,
    int4_gemm,
    int4_gemm_reference,
    sort_act_order,
)
from tritonq.quant.packing import AWQ_ORDER
from tritonq.quant.weights import Int4Weight

TOL = tolerances.table("int4_gemm")  # tests/tolerances.py: the reason of each dtype's bound


def assert_close(y, ref):
    tol = TOL[y.dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


def random_int32(*shape):
    """Arbitrary 32-bit patterns as int32 (what a checkpoint's packed tensors hold)."""
    return (torch.randint(0, 2**32, shape, dtype=torch.int64) - 2**31).to(torch.int32)


def random_scales(G, N, dtype):
    return (torch.rand(G, N) * 0.02 + 0.002).to(dtype)


def fields(packed, bits):
    """Hand unpack, independent of tritonq.quant.packing: list of uint arrays, field f = bits [f*b, (f+1)*b)."""
    u = packed.numpy().view(np.uint32).astype(np.int64)
    return [(u >> (bits * f)) & ((1 << bits) - 1) for f in range(32 // bits)]


def built_on_cpu(make):
    """`make` -> (Int4Weight, dense W ndarray) runs with the CPU as default device (checkpoint tensors are
    read on the host, as a loader does, and numpy needs host memory); the weight and W are then moved to
    the test's device."""
    @functools.wraps(make)
    def on_test_device(*args, **kwargs):
        device = torch.get_default_device()
        with torch.device("cpu"):
            w, dense = make(*args, **kwargs)
        return w.to(device), torch.from_numpy(dense).to(device)
    return on_test_device


@built_on_cpu
def awq_case(K, N, group_size, dtype):
    """Raw AWQ tensors, the Int4Weight repacked from them, and the dense W [N, K] by hand (float64), on the
    test's device."""
    gs = K if group_size == -1 else group_size
    qweight, qzeros, scales = random_int32(K, N // 8), random_int32(K // gs, N // 8), random_scales(K // gs, N, dtype)
    q, z = np.zeros((K, N)), np.zeros((K // gs, N))
    for f, (qf, zf) in enumerate(zip(fields(qweight, 4), fields(qzeros, 4))):
        q[:, AWQ_ORDER[f]::8], z[:, AWQ_ORDER[f]::8] = qf, zf  # field f holds column 8j + AWQ_ORDER[f]
    g = np.arange(K) // gs
    dense = ((q - z[g]) * scales.double().numpy()[g]).T
    return awq_to_int4(qweight, qzeros, scales, group_size), dense


@built_on_cpu
def gptq_case(K, N, bits, group_size, dtype, sym, act_order, zero_offset=1):
    """Raw GPTQ tensors (v1 if zero_offset=1) -> Int4Weight, and the dense W [N, K] by hand (float64), on the
    test's device."""
    gs = K if group_size == -1 else group_size
    per = 32 // bits
    G = K // gs
    qweight, qzeros, scales = random_int32(K // per, N), random_int32(G, N // per), random_scales(G, N, dtype)
    g_idx = (torch.randperm(K) // gs).to(torch.int32) if act_order else torch.arange(K, dtype=torch.int32) // gs
    q, z = np.zeros((K, N)), np.zeros((G, N))
    for f, (qf, zf) in enumerate(zip(fields(qweight, bits), fields(qzeros, bits))):
        q[f::per], z[:, f::per] = qf, zf + zero_offset  # sequential: field f is row / column per*j + f
    if sym:
        z[:] = 2 ** (bits - 1)
    g = g_idx.long().numpy()
    dense = ((q - z[g]) * scales.double().numpy()[g]).T
    w = gptq_to_int4(qweight, None if sym else qzeros, scales, g_idx, bits, group_size, sym, zero_offset)
    return w, dense


def awq_weight(*args):
    return awq_case(*args)[0]


def gptq_weight(*args, **kwargs):
    return gptq_case(*args, **kwargs)[0]


def with_bias(w, dtype):
    return replace(w, bias=torch.randn(w.shape[0], dtype=dtype))


@pytest.mark.parametrize("make", [
    lambda: awq_case(128, 72, 32, torch.float16),
    lambda: awq_case(384, 40, -1, torch.bfloat16),
    lambda: gptq_case(384, 72, 4, 128, torch.float16, sym=False, act_order=True),
    lambda: gptq_case(128, 40, 8, 32, torch.bfloat16, sym=False, act_order=False, zero_offset=0),
    lambda: gptq_case(384, 40, 4, 64, torch.float16, sym=True, act_order=True),
], ids=["awq-g32", "awq-per-channel", "gptq-v1-act-order", "gptq-v2-8bit", "gptq-sym-act-order"])
def test_dequantize_matches_hand_unpacked_checkpoint(make):
    w, dense = make()
    assert torch.equal(w.dequantize(), dense.to(w.scales.dtype))  # (q - z) * s is exact in fp32
    x = torch.randn(5, w.shape[1], dtype=w.scales.dtype)
    assert_close(int4_gemm_reference(x, w), x.double() @ dense.T)


# (M, case, x dtype): every M in {1, 3, 17, 64} meets both layouts, sym and asym, each group size,
# act-order, 4 and 8 bits, fp16 and bf16; N (40, 72, 200) is never a multiple of BLOCK_N.
KERNEL_CASES = [
    (1, lambda d: awq_weight(128, 72, 32, d), torch.float16),
    (1, lambda d: gptq_weight(384, 40, 4, 128, d, sym=False, act_order=True), torch.bfloat16),
    (1, lambda d: gptq_weight(128, 40, 8, 32, d, sym=True, act_order=False), torch.bfloat16),
    (3, lambda d: awq_weight(384, 200, 128, d), torch.bfloat16),
    (3, lambda d: gptq_weight(128, 72, 4, 32, d, sym=True, act_order=False), torch.float16),
    (3, lambda d: gptq_weight(384, 72, 4, 128, d, sym=False, act_order=False, zero_offset=0), torch.float32),
    (3, lambda d: gptq_weight(200, 40, 4, -1, d, sym=False, act_order=False), torch.float16),  # K % 16 != 0:
    # no BLOCK_K divides the group, so scales are gathered per row, and the last K tile is partial
    (17, lambda d: with_bias(awq_weight(384, 40, -1, d), d), torch.float16),
    (17, lambda d: gptq_weight(384, 72, 4, 64, d, sym=True, act_order=True), torch.float16),
    (17, lambda d: gptq_weight(384, 72, 8, 128, d, sym=False, act_order=True), torch.bfloat16),
    (64, lambda d: awq_weight(128, 72, 64, d), torch.bfloat16),
    (64, lambda d: with_bias(gptq_weight(384, 200, 4, -1, d, sym=False, act_order=False, zero_offset=0), d),
     torch.float16),
    (64, lambda d: gptq_weight(128, 40, 8, -1, d, sym=True, act_order=False), torch.bfloat16),
    (80, lambda d: gptq_weight(384, 72, 4, 64, d, sym=False, act_order=True), torch.float16),  # M > 64 tiles
    # 8 bits in fp16: the packed-word path (common.int8_words_minus_zero) runs here too
    (1, lambda d: gptq_weight(384, 72, 8, 128, d, sym=False, act_order=False), torch.float16),
    (3, lambda d: gptq_weight(128, 40, 8, -1, d, sym=True, act_order=False), torch.float16),
    (17, lambda d: gptq_weight(384, 200, 8, 64, d, sym=True, act_order=True), torch.float16),
    (64, lambda d: gptq_weight(128, 72, 8, 8, d, sym=False, act_order=False), torch.float16),  # per-row groups
]


@pytest.mark.parametrize("M, make, dtype", KERNEL_CASES, ids=[f"case{i}-M{c[0]}" for i, c in enumerate(KERNEL_CASES)])
def test_kernel_matches_reference(M, make, dtype):
    w = make(torch.float16 if dtype == torch.float32 else dtype)  # fp32 x: fp16 scales
    x = torch.randn(M, w.shape[1], dtype=dtype)
    y = int4_gemm(x, w)
    assert y.dtype == dtype and y.shape == (M, w.shape[0])
    assert_close(y, int4_gemm_reference(x, w))


@pytest.mark.parametrize("M, config", [
    (3, Int4GemmConfig(16, 32, 32, SPLIT_K=4)),   # split-K partials summed by the launcher
    (3, Int4GemmConfig(16, 64, 128, SPLIT_K=2)),  # BLOCK_K 128 > group 32: launcher shrinks it
    (17, Int4GemmConfig(64, 128, 64, SPLIT_K=1, num_warps=8)),
])
def test_explicit_configs_match_reference(M, config):
    assert {config.BLOCK_M, config.BLOCK_N, config.BLOCK_K} <= set(sum(CONFIG_SPACE.values(), []))
    w, _ = gptq_case(384, 72, 4, 32, torch.float16, sym=False, act_order=False)
    x = torch.randn(384, M, dtype=torch.float16).t()  # non-contiguous activations
    assert_close(int4_gemm(x, w, config=config), int4_gemm_reference(x, w))


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_weight_sorts_into_plain_groups(bits):
    """sort_act_order: the sorted weight stores the original's columns in perm order (dequantized: exact), with
    plain contiguous groups (no g_idx), and dequantizes to the original (perm puts the columns back); the kernel
    cases above run act-order through it. A Linear holds the sorted form only (the codes once)."""
    w, _ = gptq_case(256, 40, bits, 32, torch.float16, sym=False, act_order=True)
    s = sort_act_order(w)
    perm = s.perm
    assert s.g_idx is None and perm.dtype == torch.int32
    assert torch.equal(perm.sort().values.cpu(), torch.arange(256, dtype=torch.int32))
    assert torch.equal(replace(s, perm=None).dequantize(), w.dequantize()[:, perm.long()])
    assert torch.equal(s.dequantize(), w.dequantize())
    linear = Linear(w)
    assert linear.weight.perm is not None and linear.prepared.gemm.w is linear.weight
    x = torch.randn(3, 256, dtype=torch.float16, device=w.qweight.device)
    assert_close(linear(x), int4_gemm_reference(x, w))


@pytest.mark.parametrize("M", [1, 17])
def test_act_order_groups_that_do_not_sort_into_runs(M):
    """A g_idx with groups of unequal sizes (valid: every row names a scales row) cannot be sorted into plain
    groups: the kernel gathers its scales per row."""
    w, _ = gptq_case(256, 40, 4, 32, torch.float16, sym=False, act_order=True)
    w = replace(w, g_idx=torch.randint(0, 8, (256,), dtype=torch.int32, generator=torch.Generator().manual_seed(0),
                                       device="cpu").to(w.g_idx.device))
    if not w.g_idx.is_meta:  # the fake GPU's meta g_idx has no values to sort (a dry run takes the sorted form)
        assert sort_act_order(w) is None
    x = torch.randn(M, 256, dtype=torch.float16, device=w.qweight.device)
    assert_close(int4_gemm(x, w), int4_gemm_reference(x, w))


def test_torch_backend_is_the_reference(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    w, _ = awq_case(128, 40, 32, torch.float16)
    x = torch.randn(3, 128, dtype=torch.float16)
    assert torch.equal(int4_gemm(x, w), int4_gemm_reference(x, w))


@pytest.mark.parametrize("change, x_shape, x_dtype, message", [
    (dict(qweight_dtype=torch.int64), (2, 128), torch.float16, "qweight is torch.int64"),
    (dict(group_size=48), (2, 128), torch.float16, "group_size is 48"),
    (dict(bits=3), (2, 128), torch.float16, "bits is 3"),
    (dict(scales_rows=3), (2, 128), torch.float16, r"scales is of shape \(3, 40\)"),
    (dict(g_idx_bad=True), (2, 128), torch.float16, r"g_idx is in range \[0, 9\]"),
    ({}, (2, 96), torch.float16, r"x is torch.float16 of shape \(2, 96\), expected fp16/bf16/fp32 \[M, 128\]"),
    ({}, (2, 128), torch.int32, "x is torch.int32"),
    (dict(scales_view=True), (2, 128), torch.float16, "scales is non-contiguous"),
    (dict(x_elsewhere=True), (2, 128), torch.float16, "x is on OTHER, expected on the weight's device DEVICE"),
])
def test_bad_input_raises_value_error(device, change, x_shape, x_dtype, message):
    if "g_idx_bad" in change and device.type != "cpu":
        pytest.skip("off the CPU int4_gemm does not read g_idx (a sync per launch); gptq_to_int4 checks it at load")
    w, _ = awq_case(128, 40, 32, torch.float16)
    other = "meta" if device.type == "cpu" else "cpu"
    message = message.replace("OTHER", other).replace("DEVICE", str(w.qweight.device))
    if "qweight_dtype" in change:
        w = replace(w, qweight=w.qweight.to(change["qweight_dtype"]))
    if "group_size" in change:
        w = replace(w, group_size=change["group_size"])
    if "bits" in change:
        w = replace(w, bits=change["bits"])
    if "scales_rows" in change:
        w = replace(w, scales=w.scales[:change["scales_rows"]], zeros=w.zeros[:change["scales_rows"]])
    if "scales_view" in change:
        w = replace(w, scales=w.scales.t().contiguous().t())
    if "g_idx_bad" in change:
        w = replace(w, g_idx=torch.arange(128, dtype=torch.int32) // 14)  # groups 0..9, only 4 exist
    x = torch.ones(x_shape, dtype=x_dtype, device=other if "x_elsewhere" in change else device)
    with pytest.raises(ValueError, match=message):
        int4_gemm(x, w)


def test_tuned_config_from_json_store_is_used(monkeypatch):
    asked = []

    def lookup(kernel, bucket):
        asked.append((kernel, bucket))
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, num_warps=2, num_stages=2)

    import tritonq.kernels.common as common
    monkeypatch.setattr(common, "lookup", lookup)
    w, _ = gptq_case(128, 40, 4, 64, torch.float16, sym=False, act_order=False)
    x = torch.randn(3, 128, dtype=torch.float16)
    assert_close(int4_gemm(x, w), int4_gemm_reference(x, w))
    assert asked == [("int4_gemm", "M4_N40_K128_G64_B4")]


def test_bad_config_raises_value_error():
    w, _ = awq_case(128, 40, 32, torch.float16)
    with pytest.raises(ValueError, match=r"config.BLOCK_N = 24, expected a power of two >= 16"):
        int4_gemm(torch.ones(2, 128, dtype=torch.float16), w, config=Int4GemmConfig(16, 24, 32))


# ---------------------------------------------------------------- code-table weights (bitsandbytes nf4 / fp4)

NF4_TABLE = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230731010437, 0.33791524742126465, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]  # bitsandbytes' nf4 quant_map (functional.get_4bit_type("nf4"))


@built_on_cpu
def codebook_case(K, N, group_size):
    """An nf4-style Int4Weight (codes packed along K, fp32 absmax per group, the nf4 table) and the dense
    W [N, K] by hand (float64): W[n, k] = table[q[k, n]] * absmax[k // group_size, n]."""
    q = torch.randint(0, 16, (K, N), dtype=torch.int32)
    absmax = torch.rand(K // group_size, N) + 0.05
    table = np.array(NF4_TABLE, dtype=np.float32).astype(np.float64)
    dense = (table[q.numpy()] * absmax.double().numpy()[np.arange(K) // group_size]).T
    words = torch.zeros(K // 8, N, dtype=torch.int64)  # by hand: row 8j + f in bits [4f, 4f + 4) of word j
    for f in range(8):
        words |= q[f::8].long() << (4 * f)
    qweight = (words - (words >= 2**31).long() * 2**32).to(torch.int32)
    w = Int4Weight(qweight, absmax, None, None, group_size, 4, code=torch.tensor(NF4_TABLE))
    return w, dense


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, K, N, group_size", [(1, 136, 40, 8), (3, 192, 72, 64), (17, 256, 24, 32),
                                                 (64, 320, 104, 64), (3, 1024, 40, 512)])
def test_code_table_kernel_matches_hand_dequantized(M, K, N, group_size, dtype):
    """int4_gemm with a code table (HAS_CODE) at odd shapes (K, N off the tiles; groups below, at and above
    BLOCK_K) against x @ W^T over W dequantized by hand and rounded to x's dtype, as the kernel feeds its dots."""
    w, dense = codebook_case(K, N, group_size)
    assert torch.equal(w.dequantize(), dense.float())  # table value times absmax: one correctly rounded fp32 product
    x = torch.randn(M, K).to(dtype)
    ref = x.double() @ dense.to(dtype).double().T
    assert_close(int4_gemm(x, w), ref)
    assert_close(int4_gemm_reference(x, w), x.double() @ dense.T)


def test_code_table_needs_fp32_16_entries_and_no_zeros(device):
    w, _ = codebook_case(64, 32, 32)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="code is torch.float16 of shape .16.*expected fp32 \\[16\\]"):
        int4_gemm(x, replace(w, code=w.code.half()))
    with pytest.raises(ValueError, match="code is .*zeros/g_idx set: True/False"):
        int4_gemm(x, replace(w, zeros=torch.zeros_like(w.scales)))
