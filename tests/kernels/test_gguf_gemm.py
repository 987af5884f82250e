"""gguf_gemm (Triton, in the interpreter off a GPU) against a float32 matmul on the weights the gguf package
dequantizes from the same random blocks (gguf.quants.dequantize: independent of tritonq), for every block
format kept as GGUFWeight, at odd shapes: M = 1, 3, 8 (the decode word path in fp16 / bf16), 17, 64 (split-K and
tiled paths with fp32 weights), N off the 64-wide tile, K a whole number of the format's blocks but off the K tile
where the format allows (32-blocks).

Tolerances (tests/tolerances.py's int4_gemm entry, relative to max |reference|): the fp32-weight paths form each
weight in fp32 with the file's exact values (the repack's exactness is checked bit for bit below), then, as
int4_gemm, meet x in x's dtype with fp32 accumulation: fp32 differs by summation order, fp16 / bf16 by the weight's
rounding to that dtype and one rounding of y. The decode word path (every format up to 8 rows in fp16 / bf16 from
sm_80; fp16 under the interpreter) rounds no weight: x meets magic + q (IQ4: the integer level) exactly and the
affine meets the dot's fp32 result, whose cancellation of the magic's share (2^10 at most in fp16) costs ~2^-14 of
max |y|, under the same bounds.
"""
import pytest
import tolerances
import torch
from formats.gguf_files import random_experts, random_weight, routed_reference

from tritonq.formats.gguf import BLOCK_FORMATS, PLANAR
from tritonq.kernels.gguf_gemm import GGUFGemm, GGUFGemmConfig, gguf_gemm_reference
from tritonq.quant.weights import GGUFWeight

TOL = tolerances.table("int4_gemm")


def shapes(type_name):
    return [(96, 512)] if BLOCK_FORMATS[type_name][0] == 256 else [(80, 288)]


@pytest.mark.parametrize("type_name", list(PLANAR))
def test_repack_keeps_the_gguf_values_bit_for_bit(type_name):
    with torch.device("cpu"):
        w, reference = random_weight(type_name, 48, 512, seed=1)
        assert torch.equal(w.dequantize().view(torch.int32), reference.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("type_name", list(PLANAR))
def test_gguf_gemm_matches_float32_reference(type_name, dtype, device):
    for N, K in shapes(type_name):
        with torch.device("cpu"):
            w, W = random_weight(type_name, N, K)
        w, W = w.to(device), W.to(device)
        gemm = GGUFGemm(w)
        for M in (1, 3, 8, 17, 64):
            x = torch.randn(M, K, generator=torch.Generator().manual_seed(M), device="cpu")
            x = x.to(device=device, dtype=dtype)
            ref = x.float() @ W.t()
            y = gemm(x)
            assert y.dtype == dtype and y.shape == (M, N)
            tol = TOL[dtype]
            torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_decode_word_path_is_the_one_tested(type_name, device):
    """The reference tests run the word path (gguf_gemm.word_dequant) where the runtime takes it: up to 8 rows in
    fp16 (and bf16 on a GPU), not fp32, not above 8 rows, not in the batch-invariant mode (one config for every M);
    a configured K tile outside one group to the dot's rows of groups is refused."""
    from tritonq.kernels import batch_invariant_mode
    from tritonq.kernels.common import half_bit_tricks
    with torch.device("cpu"):
        w, _ = random_weight(type_name, *shapes(type_name)[0])
    w = w.to(device)  # held: a GGUFGemm holds its weight weakly
    gemm = GGUFGemm(w)

    def word(M, dtype):
        gemm(torch.zeros(M, gemm.K, dtype=dtype, device=device))
        return gemm.plans[(1 << (M - 1).bit_length(), dtype, False)].launch.args["WORD_DEQUANT"]
    assert word(1, torch.float16) and word(8, torch.float16)
    assert not word(16, torch.float16) and not word(1, torch.float32)
    assert word(1, torch.bfloat16) == half_bit_tricks(torch.zeros(1, dtype=torch.bfloat16, device=device))
    with batch_invariant_mode():
        gemm(torch.zeros(1, gemm.K, dtype=torch.float16, device=device))
        assert not gemm.plans[(1, torch.float16, True)].launch.args["WORD_DEQUANT"]
    g = w.group_size
    with pytest.raises(ValueError, match=rf"gguf_gemm: BLOCK_K of the decode word path is 1024, expected {g} to "
                                         rf"BLOCK_M \* {g} = {16 * g}"):
        gemm(torch.zeros(1, gemm.K, dtype=torch.float16, device=device), GGUFGemmConfig(16, 64, 1024, 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q5_0", "Q5_1", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_decode_word_path_at_extreme_scales_and_every_code(type_name, dtype, device):
    """Each weight row n has block scales (d, dmin / m) +-2^e_n, e_n across the file's fp16 range (-24 .. 15; in
    fp16 -14 .. -4, so that y is a normal fp16 number), and its blocks hold every code: each output column matches
    the float32 reference to the dtype's tolerance of its own largest value, so no scale hides behind a larger one.
    The magic's cancellation scales with each column's scale; the integer products stay exact at any scale."""
    exponents = list(range(-24, 16)) if dtype == torch.bfloat16 else list(range(-14, -3))
    K = 768 if BLOCK_FORMATS[type_name][0] == 256 else 288
    with torch.device("cpu"):
        w, W = random_weight(type_name, len(exponents), K, seed=3, exponents=exponents)
    assert torch.unique(w.codes()).numel() == 2 ** w.bits  # every code
    w, W = w.to(device), W.to(device)
    gemm = GGUFGemm(w)
    tol = TOL[dtype]
    for M in (1, 8):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M), device="cpu").to(device=device, dtype=dtype)
        ref = x.float() @ W.t()
        y = gemm(x).float()
        for n in range(len(exponents)):
            torch.testing.assert_close(y[:, n], ref[:, n], rtol=tol, atol=tol * ref[:, n].abs().max().item())


def test_bias_split_k_and_the_reference(device):
    """A bias is added once across split-K slices; an explicit config with SPLIT_K 4 and the torch reference
    agree with the float32 matmul."""
    with torch.device("cpu"):
        w, W = random_weight("Q6_K", 40, 1024, seed=2)
        bias = torch.randn(40)
    w = GGUFWeight(**{**w.__dict__, "bias": bias}).to(device)
    W, bias = W.to(device), bias.to(device)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0), device="cpu").to(device)
    ref = x @ W.t() + bias
    tol = TOL[torch.float32]
    for y in (GGUFGemm(w)(x, GGUFGemmConfig(16, 32, 128, SPLIT_K=4)), gguf_gemm_reference(x, w)):
        torch.testing.assert_close(y, ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_bad_weights_and_activations_are_refused():
    with torch.device("cpu"):
        w, _ = random_weight("Q5_K", 16, 256)
        with pytest.raises(ValueError, match=r"gguf_gemm: hi is None, expected torch.int32 \[8, 16\]"):
            GGUFGemm(GGUFWeight(**{**w.__dict__, "hi": None}))
        with pytest.raises(ValueError, match=r"gguf_gemm: x is torch.float32 of shape \(2, 128\), expected "
                                             r"fp16/bf16/fp32 \[M, 256\]"):
            GGUFGemm(w)(torch.zeros(2, 128))


MOE_SHAPES = {"Q4_K": (256, 256), "Q5_K": (256, 256), "Q6_K": (256, 256), "Q5_0": (96, 160), "IQ4_NL": (96, 160),
              "Q4_1": (96, 160)}
MOE_E, MOE_TOP_K = 5, 2  # 5 experts: a count off every tile


def assert_experts_match(layer, gate_up_ref, down_ref, D: int, dtype: torch.dtype, tokens, device) -> None:
    """layer (MoEExperts over GGUF experts) at each token count in tokens equals the routed float32 reference on the
    experts' gguf values (routed_reference), within tolerances.py's moe entry relative to max |reference|. fp16: x / 16,
    so that y (quadratic in x; the random K-quant weights reach ~60) stays inside fp16's range."""
    from tritonq.kernels.moe import grouped_topk
    tol = tolerances.table("moe")[dtype]
    for T in tokens:
        gen = torch.Generator().manual_seed(T)
        x = (torch.randn(T, D, generator=gen, device="cpu") / (16 if dtype == torch.float16 else 1)).to(dtype)
        topk_weights, topk_ids = grouped_topk(torch.randn(T, MOE_E, generator=gen, device="cpu"), top_k=MOE_TOP_K,
                                              renormalize=True)
        ref = routed_reference(x, gate_up_ref, down_ref, topk_weights, topk_ids)
        y = layer(x.to(device), topk_weights.to(device), topk_ids.to(device))
        assert y.dtype == dtype and y.shape == (T, D)
        torch.testing.assert_close(y.float().cpu(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("type_name, dtype, tokens", [
    ("Q4_K", torch.float32, (1, 3, 17, 64)), ("Q6_K", torch.float32, (3, 17)), ("Q5_K", torch.bfloat16, (17,)),
    ("Q5_0", torch.float32, (1, 17)), ("IQ4_NL", torch.float16, (3,)), ("Q4_K", torch.float16, (1, 3, 8, 17)),
    ("Q4_1", torch.float16, (1, 5))])
def test_gguf_experts_through_fused_moe_match_float32_reference(type_name, dtype, tokens, device):
    """Stacked GGUF experts run fused_moe's GGUF expert kernel (gguf_gemm._gguf_moe_kernel over kernels/moe's
    token alignment) and equal the routed experts on the gguf package's values: 5 experts, top-2, tokens 1 .. 64,
    D and I off the 64-wide tiles where the block allows (32-blocks); Q4_K / Q4_1 in fp16 up to 8 tokens take the
    decode word path (K tiles of 128 / 256 / 512 over 1, 4, 8 rows; ragged K tiles at D 96, I 160). Tolerance:
    tolerances.py's moe entry, relative to max |reference| (both GEMMs exact fp32 dots; fp16 / bf16: the weight
    and the hidden rounded once each; the word path rounds no weight, its affine on the dot's fp32 result)."""
    from tritonq.kernels.moe import MoEExperts
    D, inter = MOE_SHAPES[type_name]
    gate_up, down, gate_up_ref, down_ref = random_experts(type_name, MOE_E, D, inter)
    layer = MoEExperts(gate_up.to(device), down.to(device))
    assert_experts_match(layer, gate_up_ref, down_ref, D, dtype, tokens, device)



@pytest.mark.parametrize("dtype, tokens", [(torch.float32, (3, 17)), (torch.float16, (1, 3))])
def test_gguf_experts_whose_gate_and_up_differ_in_type_match_float32_reference(dtype, tokens, device):
    """Q4_K gate and Q6_K up experts, kept as they are (a PartsWeight of the two stacked GGUFWeights: one expert GEMM
    each into [gate | up], then SiLU-and-mul), with Q4_K down, equal the routed experts on the gguf package's values;
    fp16 at 1 and 3 tokens runs the Q4_K GEMMs' decode word path beside the Q6_K's fp32 weights. Tolerance as above
    (the hidden's halves rounded to x's dtype once more, before the activation, as transformers' experts do)."""
    from tritonq.kernels.moe import MoEExperts
    from tritonq.quant.weights import PartsWeight, stack_experts
    D, inter = MOE_SHAPES["Q4_K"]

    def experts(type_name, N, K, seed):
        with torch.device("cpu"):
            weights = [random_weight(type_name, N, K, seed=seed + e) for e in range(MOE_E)]
        return stack_experts([w for w, _ in weights]), [W for _, W in weights]
    (gate, gate_ref), (up, up_ref) = experts("Q4_K", inter, D, 10), experts("Q6_K", inter, D, 20)
    down, down_ref = experts("Q4_K", D, inter, 30)
    gate_up_ref = [torch.cat([g, u]) for g, u in zip(gate_ref, up_ref)]
    layer = MoEExperts(PartsWeight((gate.to(device), up.to(device))), down.to(device))
    assert_experts_match(layer, gate_up_ref, down_ref, D, dtype, tokens, device)


def test_gguf_experts_decode_word_path_is_the_one_tested(device):
    """The reference test above runs the experts' decode word path where the runtime takes it (kernels/moe's
    `diagonal_path`): Q4_K up to 8 tokens in fp16 (and bf16 on a GPU), one row block per routed expert at one token;
    not fp32, not above 8 tokens; Q6_K experts keep the fp32 weights (at the shared row block)."""
    from tritonq.kernels.common import half_bit_tricks
    from tritonq.kernels.moe import MoEExperts
    gate_up, down, _, _ = random_experts("Q4_K", 2, 256, 256)
    q6k_down = random_experts("Q6_K", 2, 256, 256)[1]
    layers = MoEExperts(gate_up.to(device), down.to(device)), MoEExperts(gate_up.to(device), q6k_down.to(device))

    def words(T, dtype, layer=layers[0]):
        plan = layer._plan_for(torch.zeros(T, 256, dtype=dtype, device=device), T, 2, None, None)
        return plan.block_m, [launch.args["WORD_DEQUANT"] for launch, _, _ in plan.gemms]
    assert words(1, torch.float16) == (1, [True, True]) and words(8, torch.float16) == (8, [True, True])
    assert words(16, torch.float16)[1] == [False, False] and words(1, torch.float32)[1] == [False, False]
    assert words(1, torch.bfloat16)[1] == [half_bit_tricks(torch.zeros(1, dtype=torch.bfloat16, device=device))] * 2
    assert words(1, torch.float16, layers[1]) == (1, [True, False])


def test_bad_gguf_experts_are_refused():
    """Experts of different block types cannot share the expert kernel; a 2-D weight is no stacked one; GGUF experts
    take no clamped SwiGLU (gpt-oss's); a gate_up of typed parts is a gate and an up of I rows each."""
    from tritonq.kernels.common import ClampedSwiGLU
    from tritonq.kernels.moe import MoEExperts
    from tritonq.quant.weights import PartsWeight, stack_experts
    with torch.device("cpu"):
        q4k, _ = random_weight("Q4_K", 32, 256)
        q6k, _ = random_weight("Q6_K", 32, 256)
        with pytest.raises(ValueError, match=r"share their GGUF block type and shape .* found \[\('Q4_K', \(32, 256\)\), "
                                             r"\('Q6_K', \(32, 256\)\)\]: re-quantize"):
            stack_experts([q4k, q6k])
        with pytest.raises(ValueError, match="must be a stacked"):
            q4k.stacked_shape("fused_moe: gate_up")
        gate_up, down, _, _ = random_experts("Q4_K", 2, 256, 256)
        layer = MoEExperts(gate_up, down, ClampedSwiGLU())
        with pytest.raises(ValueError, match=r"gguf_gemm: \(bias, activation\) is .* expected no bias and "
                                             r"SiLU-and-mul"):
            layer(torch.zeros(1, 256), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32))
        q6k_96, _ = random_weight("Q6_K", 96, 256)
        q41, _ = random_weight("Q4_1", 256, 64)
        uneven = PartsWeight((stack_experts([q4k, q4k]), stack_experts([q6k_96, q6k_96])))  # 32 + 96 rows: I = 64
        with pytest.raises(ValueError, match=r"fused_moe: gate_up of typed parts must be a gate and an up part of "
                                             r"I=64 rows each run by SiLU-and-mul, got parts of \[32, 96\] rows"):
            MoEExperts(uneven, stack_experts([q41, q41]))
