"""The CPU backend (kernels/cpu/lowbit.py) against the float32 torch references, every format variant,
at odd shapes: M = 1, 3 (int4 kernel), 17, 64, 130 (int4: inductor's int4 GEMM template; the per-call
dequantize + bf16 GEMM where it cannot run, tested apart); N not a
multiple of the packed layout's 64 columns; K three groups (not a multiple of the larger kernel groups)
or, per-channel, not a multiple of 32 at all.

Tolerances (stated once, justified in kernels/cpu/lowbit.py):
  int4 (bf16 activations, scales, float zeros, output and, dequantize path, W; fp32 accumulation):
      elementwise |y - ref| <= INT4_BOUND * (|x| @ T^T), T[n, k] = scale * (|q - 8| + |8 - z|): four
      bf16 roundings (unit roundoff 2^-8 each) of the magnitude of the terms summed, plus the reference's
      fp16 W (2^-11); the relative norm of the error is also checked (< 2^-6: it is ~3e-3, RMS).
  symmetric 8-bit (int8 codes, the C int8 linear): against W = code * scale in fp32 (exact for half scales),
      summation order only: rtol 1e-5, atol 1e-5 * max |ref|; bf16 activations: the same sums rounded once to
      bf16 (one rounding of each, 2^-8 relative).
  fp32 paths (8-bit GPTQ with zeros or act-order, FP8, int4 groups the kernel cannot take): the same dequantized values
      and arithmetic as the reference, summation order only: rtol 1e-5, atol 1e-5 * max |ref|.
      FP8 runs weight-only by default on CPU (as below sm_89): compared with the weight-only reference.
  MoE: two GEMMs and a SiLU in series; int4 experts: ||y - ref|| <= 2^-6 ||ref|| (each bf16 GEMM
      is ~3e-3 relative, RMS); fp32 experts as above.
"""
from dataclasses import replace

import pytest
import torch

from tritonq.kernels.cpu import lowbit as cpu_lowbit
from tritonq.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference
from tritonq.kernels.int4_gemm import int4_gemm, int4_gemm_reference
from tritonq.kernels.moe import fused_moe, fused_moe_reference
from tritonq.formats.layers import Linear
from tritonq.quant.packing import unpack_int32
from tritonq.quant.rtn import quantize_fp8, quantize_int4
from tritonq.quant.weights import FP8Weight, GGUFWeight, Int4Weight, PartsWeight, stack_experts

MS = [1, 3, 17, 64, 130]
N = 72  # not a multiple of 64: the packed weight gets padded columns
INT4_BOUND = 2**-6 + 2**-11

INT4_CASES = {  # name: (K, quantize_int4 options)
    "awq_g128_asym": (384, dict(group_size=128, sym=False)),
    "gptq_g32_sym": (96, dict(group_size=32, sym=True)),
    "gptq_g64_asym": (192, dict(group_size=64, sym=False)),
    "gptq_g256_sym": (768, dict(group_size=256, sym=True)),
    "gptq_g96_asym": (288, dict(group_size=96, sym=False)),  # kernel groups of 32 inside ours
    "per_channel_asym_K200": (200, dict(group_size=-1, sym=False)),  # K padded to 224
    "per_channel_sym_K512": (512, dict(group_size=-1, sym=True)),
    "act_order_g32_sym": (96, dict(group_size=32, sym=True, act_order=True)),
    "act_order_g128_asym": (384, dict(group_size=128, sym=False, act_order=True)),
}
INT8_CASES = {  # symmetric 8-bit group weights (GGUF Q8_0's form), kept as int8 codes: (K, group, scale dtype)
    "q8_0_form_g32_fp16": (160, 32, torch.float16),  # K five groups: off any power-of-two tile
    "q8_0_form_g32_bf16": (96, 32, torch.bfloat16),  # a bf16 model's GGUF Q8_0 (d rounded to bf16 at load)
    "gptq8_sym_g128_fp32": (384, 128, torch.float32),
    "per_channel_K200_fp32": (200, -1, torch.float32),  # bitsandbytes LLM.int8()'s form: one group of K
}
FP32_CASES = {  # typed weights the CPU backend dequantizes once to fp32
    "gptq8_g32_asym": lambda: quantize_int4(torch.randn(N, 96), group_size=32, bits=8),
    "gptq8_g64_sym_act_order": lambda: quantize_int4(torch.randn(N, 192), group_size=64, sym=True, bits=8,
                                                     act_order=True),
    "gptq8_per_channel": lambda: quantize_int4(torch.randn(N, 200), group_size=-1, bits=8),
    "int4_g16": lambda: quantize_int4(torch.randn(N, 96), group_size=16),
    "nf4_code_table_g64": lambda: replace(quantize_int4(torch.randn(N, 192), group_size=64, sym=True), zeros=None,
                                          scales=torch.rand(3, N) + 0.1, code=torch.linspace(-1, 1, 16) ** 3),
}
FP8_CASES = {
    "fp8_tensor": lambda: quantize_fp8(torch.randn(N, 200), "tensor"),
    "fp8_channel": lambda: quantize_fp8(torch.randn(N, 200), "channel"),
    "fp8_block": lambda: quantize_fp8(torch.randn(200, 328), "block"),  # partial blocks in N and K
    "fp8_static_input": lambda: replace(quantize_fp8(torch.randn(N, 200), "channel"),
                                        input_scale=torch.tensor(0.02)),
}


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)


def with_bias(w):
    return replace(w, bias=torch.randn(w.shape[0]).to(torch.float16))


def int4_term_magnitudes(w: Int4Weight) -> torch.Tensor:
    """T [N, K] = scale * (|q - 8| + |8 - z|), from the raw fields (independent of cpu_lowbit)."""
    q = unpack_int32(w.qweight, 4, dim=0).float()
    K = q.shape[0]
    g = w.g_idx.long() if w.g_idx is not None else torch.arange(K) // w.group_size
    zero_term = (8 - w.zeros.float()[g]).abs() if w.zeros is not None else 0.0
    return (w.scales.float()[g] * ((q - 8).abs() + zero_term)).t()


def assert_fp32_close(y, ref):
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("name", list(INT4_CASES))
def test_int4_cpu_kernel_matches_reference(name, M):
    K, options = INT4_CASES[name]
    w = with_bias(quantize_int4(torch.randn(N, K), **options))
    assert isinstance(cpu_lowbit.prepare(w), cpu_lowbit.CPUInt4Weight)
    x = torch.randn(M, K)
    y, ref = int4_gemm(x, w), int4_gemm_reference(x, w)
    assert y.shape == (M, N) and y.dtype == torch.float32
    bound = INT4_BOUND * (x.abs() @ int4_term_magnitudes(w).t())
    excess = ((y - ref).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds the bf16 bound by {excess}"
    assert ((y - ref).norm() / ref.norm()).item() < 2**-6  # and is not just inside a loose bound


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_repacked_in_row_blocks_equals_one_repack(monkeypatch, act_order):
    """The load-time repack runs PACK_ROWS output rows at a time (small int32 temporaries); N = 600 spans
    three blocks, the last partial and padded to 640: the packed bytes equal one repack of the whole
    weight, and the GEMM still matches the reference."""
    w = quantize_int4(torch.randn(600, 256), group_size=64, sym=False, act_order=act_order)
    blocked = cpu_lowbit._prepare_int4(w)
    monkeypatch.setattr(cpu_lowbit, "PACK_ROWS", 1 << 30)
    whole = cpu_lowbit._prepare_int4(w)
    assert blocked.packed.shape == whole.packed.shape == (640, 128)
    assert torch.equal(blocked.packed, whole.packed)
    for M in (3, 40):  # the int4 kernel and the dequantize path
        x = torch.randn(M, 256)
        y, ref = cpu_lowbit.linear(x, blocked), int4_gemm_reference(x, w)
        assert ((y - ref).norm() / ref.norm()).item() < 2**-6


@pytest.mark.parametrize("name", list(INT4_CASES))
def test_int4_unpacked_from_cpu_layout_matches_dequantize(name):
    """The per-call unpack of the CPU layout (prefill path) gives w.dequantize() in the kernel's K order,
    within bf16 rounding of the scale and float zero, then of W (|error| <= 2 * 2^-8 * T + the reference's
    fp16 W, 2^-11)."""
    K, options = INT4_CASES[name]
    w = quantize_int4(torch.randn(N, K), **options)
    p = cpu_lowbit.prepare(w)
    w_t = cpu_lowbit._dequantize_bf16(p).float()
    assert w_t.shape == (p.packed.shape[1] * 2, p.packed.shape[0])
    order = p.perm if p.perm is not None else torch.arange(K)
    ref, terms = w.dequantize().float()[:, order].t(), int4_term_magnitudes(w)[:, order].t()
    assert ((w_t[:K, :N] - ref).abs() <= (2**-7 + 2**-11) * terms + 1e-30).all()
    assert (w_t[:, N:] == 0).all()  # padded outputs are 0 (padded K rows meet x's zero padding)


def test_int4_paths_by_rows(monkeypatch):
    """Up to TEMPLATE_ABOVE_M rows the eager kernel; above, inductor's template; where the template cannot run,
    the kernel up to DEQUANTIZE_ABOVE_M rows and dequantize + bf16 GEMM above."""
    dequantized, templated = [], []
    real_dequantize, real_template = cpu_lowbit._dequantize_bf16, cpu_lowbit._template_gemm
    monkeypatch.setattr(cpu_lowbit, "_dequantize_bf16", lambda p: dequantized.append(1) or real_dequantize(p))
    monkeypatch.setattr(cpu_lowbit, "_template_gemm", lambda p: templated.append(1) or real_template(p))
    w = quantize_int4(torch.randn(N, 128), group_size=32)
    int4_gemm(torch.randn(cpu_lowbit.TEMPLATE_ABOVE_M, 128), w)
    assert not templated and not dequantized
    int4_gemm(torch.randn(cpu_lowbit.DEQUANTIZE_ABOVE_M + 1, 128), w)
    assert templated == [1] and not dequantized
    monkeypatch.setattr(cpu_lowbit, "_template_gemm", lambda p: None)  # no AVX512, or the compile failed
    int4_gemm(torch.randn(cpu_lowbit.DEQUANTIZE_ABOVE_M, 128), w)
    assert not dequantized
    int4_gemm(torch.randn(cpu_lowbit.DEQUANTIZE_ABOVE_M + 1, 128), w)
    assert dequantized == [1]


@pytest.mark.parametrize("M", [40, 130])
@pytest.mark.parametrize("name", ["awq_g128_asym", "gptq_g256_sym", "act_order_g32_sym"])
def test_int4_dequantize_path_matches_reference(monkeypatch, name, M):
    """The fallback above DEQUANTIZE_ABOVE_M rows where the template cannot run (MS's rows above 8 take the
    template): same bound as the kernel."""
    monkeypatch.setattr(cpu_lowbit, "_template_gemm", lambda p: None)
    K, options = INT4_CASES[name]
    w = with_bias(quantize_int4(torch.randn(N, K), **options))
    x = torch.randn(M, K)
    y, ref = int4_gemm(x, w), int4_gemm_reference(x, w)
    assert ((y - ref).abs() - INT4_BOUND * (x.abs() @ int4_term_magnitudes(w).t())).max().item() <= 0
    assert ((y - ref).norm() / ref.norm()).item() < 2**-6


def test_int4_template_compiles_once_per_weight_and_keeps_weights_apart():
    """Two weights of one shape each get their own compiled GEMM (freezing bakes the weight in: a shared graph
    would give the second weight the first one's products), and row counts after the first compile nothing."""
    if cpu_lowbit._template_gemm(cpu_lowbit.prepare(quantize_int4(torch.randn(N, 256), group_size=128))) is None:
        pytest.skip("inductor's int4 template does not compile on this CPU (no AVX512): the eager paths run")
    weights = [quantize_int4(torch.randn(N, 256), group_size=128) for _ in range(2)]
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for w in weights:
        int4_gemm(torch.randn(cpu_lowbit.TEMPLATE_ABOVE_M + 1, 256), w)  # compiles w's GEMM
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles + 2
    compiles += 2
    for M in (17, 64, 130, 300):
        x = torch.randn(M, 256)
        for w in weights:
            y, ref = int4_gemm(x, w), int4_gemm_reference(x, w)
            assert ((y - ref).norm() / ref.norm()).item() < 2**-6
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_cpu_kernel_keeps_16_bit_activations(dtype):
    w = quantize_int4(torch.randn(N, 128), group_size=32)
    x = torch.randn(5, 128).to(dtype)
    y, ref = int4_gemm(x, w), int4_gemm_reference(x, w)
    assert y.dtype == dtype
    bound = INT4_BOUND * (x.float().abs() @ int4_term_magnitudes(w).t()) + 2**-8 * ref.float().abs()  # + output rounding
    assert ((y.float() - ref.float()).abs() <= bound).all()


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("name", list(FP32_CASES))
def test_int_weights_dequantized_once_match_reference(name, M):
    w = with_bias(FP32_CASES[name]())
    assert isinstance(cpu_lowbit.prepare(w), cpu_lowbit.CPUDenseWeight)
    x = torch.randn(M, w.shape[1])
    assert_fp32_close(int4_gemm(x, w), int4_gemm_reference(x, w))


def int8_case(name: str) -> Int4Weight:
    K, group, scale_dtype = INT8_CASES[name]
    return with_bias(quantize_int4(torch.randn(N, K), group_size=group, sym=True, bits=8, scale_dtype=scale_dtype))


def exact_int8_reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x @ W^T + bias in fp32, W[n, k] = (q - 128) * scale in fp32 from the raw fields (no rounding to the scales'
    dtype: GGUF's own d * q), rounded once to x.dtype."""
    q = unpack_int32(w.qweight, 8, dim=0).float() - 128  # [K, N]
    W = q * w.scales.float().repeat_interleave(w.group_size, dim=0)
    return (x.float() @ W + w.bias.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", MS[:4])
@pytest.mark.parametrize("name", list(INT8_CASES))
def test_symmetric_int8_weights_keep_codes_and_match_the_fp32_reference(name, M, dtype):
    w = int8_case(name)
    p = cpu_lowbit.prepare(w)
    assert isinstance(p, cpu_lowbit.CPUInt8Weight) and p.codes.dtype == torch.int8
    K = w.shape[1]
    assert p.codes.shape == (2, K, 64) and p.scales.shape == (2, w.scales.shape[0], 64)  # N = 72 padded to 128
    x = torch.randn(M, K).to(dtype)
    y, ref = int4_gemm(x, w), exact_int8_reference(x, w)
    assert y.dtype == dtype and y.shape == (M, N)
    if dtype == torch.float32:
        assert_fp32_close(y, ref)
    else:
        torch.testing.assert_close(y.float(), ref.float(), rtol=2**-8, atol=2**-8 * ref.abs().max().item())


def test_symmetric_int8_with_fp32_scales_equals_the_oracle():
    """fp32 scales: W = (q - 128) * scale is the reference's own fp32 value, so the int8 linear matches
    int4_gemm_reference (TRITONQ_BACKEND=torch) to fp32 summation order, at M above the row blocks too."""
    w = int8_case("gptq8_sym_g128_fp32")
    x = torch.randn(130, w.shape[1])
    assert_fp32_close(int4_gemm(x, w), int4_gemm_reference(x, w))


def test_symmetric_int8_takes_1_125_bytes_a_weight_at_group_32():
    """N = 320: the codes are repacked at load in slices of 256 columns, and a whole number of 64-column blocks."""
    w = with_bias(quantize_int4(torch.randn(320, 512), group_size=32, sym=True, bits=8))
    p = cpu_lowbit.prepare(w)
    stored = p.codes.numel() * p.codes.element_size() + p.scales.numel() * p.scales.element_size()
    assert stored / (320 * 512) == 1.125
    x = torch.randn(2, 512)
    assert_fp32_close(cpu_lowbit.linear(x, p), exact_int8_reference(x, w))


def test_symmetric_int8_runs_as_one_op_in_a_compiled_graph():
    """A compiled decode step traces the linear: the C call is one opaque op (its Meta shape), same values."""
    w = int8_case("q8_0_form_g32_fp16")
    p = cpu_lowbit.prepare(w)
    x = torch.randn(3, w.shape[1])
    compiled = torch.compile(lambda rows: cpu_lowbit.linear(rows, p), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), cpu_lowbit.linear(x, p))


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_dequantized_once_matches_reference(name, M):
    w = with_bias(FP8_CASES[name]())
    w = replace(w, bias=w.bias.float())
    assert isinstance(cpu_lowbit.prepare(w), cpu_lowbit.CPUDenseWeight)
    x = torch.randn(M, w.shape[1])
    assert_fp32_close(fp8_gemm(x, w), fp8_gemm_reference(x, w, weight_only=True))  # CPU default: weight-only
    assert_fp32_close(fp8_gemm(x, w, weight_only=False), fp8_gemm_reference(x, w))  # e4m3 activations on both


def test_weight_prepared_once_at_load_not_per_call(monkeypatch):
    calls = []
    real = cpu_lowbit._prepare
    monkeypatch.setattr(cpu_lowbit, "_prepare", lambda w, *a: calls.append(w) or real(w, *a))
    w = quantize_int4(torch.randn(N, 128), group_size=32)
    layer = Linear(w)  # prepares here
    assert len(calls) == 1
    for M in (1, 4):
        layer(torch.randn(2, M, 128))
    assert len(calls) == 1 and cpu_lowbit.prepare(w) is cpu_lowbit.prepare(w)


def test_torch_backend_still_runs_the_references(monkeypatch):
    w4 = quantize_int4(torch.randn(N, 128), group_size=32)
    w8 = quantize_fp8(torch.randn(N, 128), "channel")
    x = torch.randn(3, 128)
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    monkeypatch.setattr(cpu_lowbit, "linear", lambda *a: pytest.fail("CPU backend used under TRITONQ_BACKEND=torch"))
    assert torch.equal(Linear(w4)(x), int4_gemm_reference(x, w4))
    assert torch.equal(Linear(w8)(x), fp8_gemm_reference(x, w8))  # W8A8 emulation, as before
    assert w4 not in cpu_lowbit._prepared  # nothing prepared at load either


@pytest.mark.interpreter  # imported natively (CUDA), Triton would compile the kernel and get CPU pointers
def test_interpreter_still_runs_the_triton_kernel(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cpu_lowbit, "linear", lambda *a: pytest.fail("CPU backend used under TRITON_INTERPRET=1"))
    w = quantize_int4(torch.randn(32, 64), group_size=32)
    x = torch.randn(2, 64)
    y, ref = int4_gemm(x, w), int4_gemm_reference(x, w)  # test_int4_gemm.py's fp32 tolerance
    torch.testing.assert_close(y, ref, rtol=2**-11, atol=2**-11 * ref.abs().max().item())


# ------------------------------------------------------------------ MoE experts

E, D, INTER = 4, 96, 96  # K = 3 groups of 32 for both GEMMs


def stacked(kind: str, n: int, k: int):
    if kind == "int4_asym":
        return stack_experts([quantize_int4(torch.randn(n, k), group_size=32) for _ in range(E)])
    if kind == "int4_act_order":
        return stack_experts([quantize_int4(torch.randn(n, k), group_size=32, sym=True, act_order=True)
                              for _ in range(E)])
    if kind == "int8":
        return stack_experts([quantize_int4(torch.randn(n, k), group_size=32, bits=8) for _ in range(E)])
    if kind == "fp8_block":
        return stack_experts([quantize_fp8(torch.randn(n, k), "block", block_size=(32, 32)) for _ in range(E)])
    if kind == "parts":  # a gate and an up of different types (GGUF's can differ): each runs as it is
        return PartsWeight((stacked("int8", n // 2, k), stacked("fp8_channel", n // 2, k)))
    return stack_experts([quantize_fp8(torch.randn(n, k), "channel") for _ in range(E)])


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("kind", ["int4_asym", "int4_act_order", "int8", "fp8_block", "fp8_channel", "parts"])
def test_moe_experts_match_reference(kind, T):
    gate_up, down = stacked(kind, 2 * INTER, D), stacked("int8" if kind == "parts" else kind, D, INTER)
    x = torch.randn(T, D)
    topk_weights = torch.rand(T, 2)
    topk_ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)]).to(torch.int32)
    y, ref = fused_moe(x, gate_up, down, topk_weights, topk_ids), fused_moe_reference(x, gate_up, down,
                                                                                     topk_weights, topk_ids)
    assert len(cpu_lowbit.prepare_experts(down)) == E
    if kind.startswith("int4"):
        assert isinstance(cpu_lowbit.prepare_experts(down)[0], cpu_lowbit.CPUInt4Weight)
        assert ((y - ref).norm() / ref.norm()).item() < 2**-6
    else:
        assert_fp32_close(y, ref)


def test_fp8_expert_slices_keep_scale_layout():
    w = stacked("fp8_block", D, INTER)
    e = w.expert(2)
    assert isinstance(e, FP8Weight) and e.weight_scale.shape == (3, 3) and e.block_size == (32, 32)
    torch.testing.assert_close(e.dequantize(), w.weight[2].float() * w.weight_scale[2].repeat_interleave(32, 0)
                               .repeat_interleave(32, 1))


@pytest.mark.parametrize("M", MS)
@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K", "IQ4_XS"])
def test_gguf_weights_on_the_cpu_backend(type_name, M):
    """GGUFWeight through a Linear against a float32 matmul on the gguf package's dequantization of the same
    blocks: kept in its planes (no other copy) and run by the C GGUF linear on the gguf package's values, so the
    summation order only (tests/kernels/cpu/test_cpu_gguf.py checks the kernel itself at more shapes)."""
    from formats.gguf_files import random_weight
    w, W = random_weight(type_name, 96, 512)
    w = replace(w, bias=torch.randn(96))
    x = torch.randn(M, 512)
    ref = x @ W.t() + w.bias
    y = Linear(w)(x)
    assert cpu_lowbit.prepare(w) is w and w not in cpu_lowbit._prepared  # no copy of the weight
    assert_fp32_close(y, ref)


@pytest.mark.parametrize("type_name, D, inter", [("Q4_K", 256, 256), ("Q6_K", 256, 256), ("IQ4_NL", 96, 160)])
def test_gguf_experts_on_the_cpu_backend_match_float32_reference(type_name, D, inter):
    """The CPU backend's GGUF experts (5, top-2, 17 tokens) against the routed experts on the gguf package's values:
    each expert kept in its planes and run by the C GGUF linear (the fp32 paths' tolerance)."""
    from formats.gguf_files import random_experts, routed_reference

    from tritonq.kernels.moe import grouped_topk
    gate_up, down, gate_up_ref, down_ref = random_experts(type_name, 5, D, inter)
    x = torch.randn(17, D)
    topk_weights, topk_ids = grouped_topk(torch.randn(17, 5), top_k=2, renormalize=True)
    ref = routed_reference(x, gate_up_ref, down_ref, topk_weights, topk_ids)
    y = fused_moe(x, gate_up, down, topk_weights, topk_ids)
    assert all(isinstance(p, GGUFWeight) for p in cpu_lowbit.prepare_experts(down))
    assert_fp32_close(y, ref)
