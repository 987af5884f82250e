"""tritonq.quant.weights: what each typed weight does on its own (no kernel): stacking experts and taking
one back, the device move, dequantization against a float64 reference computed from the integer
codes, and the layout questions the MoE kernel asks."""
import numpy as np
import pytest
import torch

from tritonq.quant.packing import pack_int32
from tritonq.quant.weights import DenseWeight, FP8Weight, Int4Weight, concat_outputs, stack_experts

N, K, E = 24, 96, 3  # N is not a multiple of 8 packs' worth of anything the kernels tile by


def int4(sym=False, act_order=False, gen=None):
    """An Int4Weight (group 32) and its dense W [N, K] in float64, from codes drawn here."""
    q = torch.randint(0, 16, (K, N), generator=gen, dtype=torch.int32)
    scales = (torch.rand(K // 32, N, generator=gen) * 0.1 + 0.01).to(torch.float16)
    zeros = None if sym else torch.randint(0, 16, (K // 32, N), generator=gen).to(torch.float16)
    g = torch.randperm(K, generator=gen) // 32 if act_order else torch.arange(K) // 32
    z = np.full((K // 32, N), 8.0) if sym else zeros.double().numpy()
    dense = ((q.double().numpy() - z[g.numpy()]) * scales.double().numpy()[g.numpy()]).T
    w = Int4Weight(pack_int32(q, 4, dim=0), scales, zeros, g.to(torch.int32) if act_order else None, 32, 4)
    return w, torch.from_numpy(dense)


def fp8(scheme, gen=None):
    codes = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = {"tensor": torch.tensor(0.01), "channel": torch.rand(N, 1, generator=gen) + 0.5,
             "block": torch.rand(1, 2, generator=gen) + 0.5}[scheme]
    w = FP8Weight(codes, scale, (32, 64) if scheme == "block" else None)
    if scheme == "block":  # N=24 rows lie in one block row; K=96 columns in blocks of 64 and 32
        s = scale.double()[0].repeat_interleave(64)[:K].expand(N, K)
    else:
        s = scale.double()
    return w, codes.double() * s


@pytest.mark.parametrize("case", ["int4", "int4-sym-act-order", "fp8-tensor", "fp8-channel", "fp8-block"])
def test_dequantize_matches_float64_reference(case):
    gen = torch.Generator().manual_seed(1)
    w, dense = (int4(gen=gen) if case == "int4" else int4(sym=True, act_order=True, gen=gen) if case.startswith("int4")
                else fp8(case.removeprefix("fp8-"), gen=gen))
    assert w.shape == (N, K)
    exact = w.dequantize(torch.float32)
    assert exact.dtype == torch.float32 and torch.equal(exact.double(), dense.float().double())
    default = w.dequantize()
    assert default.dtype == (torch.float16 if case.startswith("int4") else torch.float32)
    assert torch.equal(default, exact.to(default.dtype))


def test_dense_dequantize_is_the_weight():
    w = DenseWeight(torch.randn(N, K, dtype=torch.bfloat16))
    assert w.dequantize() is w.weight and torch.equal(w.dequantize(torch.float32), w.weight.float())


def test_stack_then_expert_gives_back_each_part():
    gen = torch.Generator().manual_seed(2)
    for parts in ([DenseWeight(torch.randn(N, K), torch.randn(N)) for _ in range(E)],
                  [int4(act_order=True, gen=gen)[0] for _ in range(E)],
                  [fp8("channel", gen=gen)[0] for _ in range(E)],
                  [fp8("tensor", gen=gen)[0] for _ in range(E)]):
        stacked = stack_experts(parts)
        assert type(stacked) is type(parts[0]) and stacked.num_experts == E
        if stacked.bias is None:
            assert stacked.stacked_shape("experts") == (E, N, K)
        for e, part in enumerate(parts):
            back = stacked.expert(e)
            assert back.shape == (N, K) and back.tensors().keys() == part.tensors().keys()
            assert all(torch.equal(back.tensors()[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else
                                   back.tensors()[k], v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
                       for k, v in part.tensors().items())


def test_stacked_shape_refuses_a_2d_weight_and_mismatched_scales():
    w, _ = int4()
    with pytest.raises(ValueError, match="moe: w must be a stacked .* got a 2-D Int4Weight"):
        w.stacked_shape("moe: w")
    stacked = stack_experts([w, w])
    bad = Int4Weight(stacked.qweight, stacked.scales[:1], None, None, 32)
    with pytest.raises(ValueError, match=r"scales shape \(1, 3, 24\) must be \[E=2, G, N=24\]"):
        bad.stacked_shape("moe: w")


def test_to_moves_every_tensor_and_keeps_the_rest():
    w, _ = int4(act_order=True)
    moved = w.to("meta")
    assert {t.device.type for t in moved.tensors().values()} == {"meta"} and len(moved.tensors()) == 4
    assert (moved.group_size, moved.bits, moved.device.type) == (32, 4, "meta")


def test_scales_constant_over_tiles():
    w, _ = int4()
    assert w.scales_constant_over(16) and w.scales_constant_over(32) and not w.scales_constant_over(64)
    assert not int4(act_order=True)[0].scales_constant_over(16)  # act-order: any row may be in any group
    block, _ = fp8("block")
    assert block.scales_constant_over(64) and not block.scales_constant_over(128)
    assert fp8("channel")[0].scales_constant_over(128)
    assert not DenseWeight(torch.randn(N, K)).scales_constant_over(16)


def test_check_g_idx_names_the_bad_range():
    w, _ = int4(act_order=True)
    bad = Int4Weight(w.qweight, w.scales, w.zeros, w.g_idx + 1, 32)
    with pytest.raises(ValueError, match=r"g_idx is in range \[1, 3\], expected in \[0, 3\)"):
        bad.dequantize()


def test_concat_outputs_refuses_mixed_types():
    with pytest.raises(ValueError, match=r"different types \['DenseWeight', 'Int4Weight'\]"):
        concat_outputs([DenseWeight(torch.randn(N, K)), int4()[0]])
