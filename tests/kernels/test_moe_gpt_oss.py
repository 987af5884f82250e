"""gpt-oss experts in fused_moe (expert biases, the clamped SwiGLU) against transformers' GptOssExperts.

The independent reference is transformers' own expert loop (fp32) over the same weights, given in its
layout (gate_up_proj [E, D, 2I] with gate/up columns interleaved); ours takes them as [E, N, K] with the
gate rows first, as the loader hands them over (formats/base.py `get_fused_experts`). Odd shapes: D, I
off every tile (48, 40), E = 5, T = 1, 3, 17, 64 tokens with top-2 routing; gate/up logits of several
units, so both clamps are hit. MXFP4 experts (D = I = 96: off the 64-wide tiles, whole 32-element
groups) against transformers' experts on transformers' own dequantization of the same blocks.
Tolerances: tests/tolerances.py "moe".
"""
from dataclasses import replace

import pytest
import torch
import tolerances
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from tritonq.kernels.common import ClampedSwiGLU
from tritonq.kernels.moe import fused_moe, fused_moe_reference, grouped_topk
from tritonq.quant.weights import DenseWeight

TOL = tolerances.table("moe")
E, D, INTER, TOP_K = 5, 48, 40, 2


def hf_experts(generator) -> GptOssExperts:
    """transformers' experts on the CPU (the reference runs there whatever the test's device)."""
    config = GptOssConfig(hidden_size=D, intermediate_size=INTER, num_local_experts=E, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16)
    with torch.device("cpu"):
        experts = GptOssExperts(config)
    with torch.no_grad():
        for param, std in ((experts.gate_up_proj, 0.6), (experts.gate_up_proj_bias, 0.5),
                           (experts.down_proj, 0.2), (experts.down_proj_bias, 0.3)):
            param.copy_(torch.randn(param.shape, generator=generator, device="cpu") * std)
    return experts


def ours(experts: GptOssExperts, device) -> tuple[DenseWeight, DenseWeight]:
    """transformers' [E, K, N] tensors as stacked [E, N, K] weights, gate rows before up rows."""
    order = torch.cat([torch.arange(0, 2 * INTER, 2), torch.arange(1, 2 * INTER, 2)])
    gate_up = DenseWeight(experts.gate_up_proj.detach().transpose(1, 2)[:, order].contiguous().to(device),
                          experts.gate_up_proj_bias.detach()[:, order].contiguous().to(device))
    down = DenseWeight(experts.down_proj.detach().transpose(1, 2).contiguous().to(device),
                       experts.down_proj_bias.detach().contiguous().to(device))
    return gate_up, down


def routed(T, generator, device):
    """CPU x [T, D] and routing (top-2 of random logits, renormalized softmax)."""
    x = torch.randn(T, D, generator=generator, device="cpu")
    weights, ids = grouped_topk(torch.randn(T, E, generator=generator, device="cpu"), TOP_K, renormalize=True)
    return x, weights, ids


def expected(experts, x, weights, ids):
    with torch.no_grad():
        return experts(x, ids.long(), weights)


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_with_biases_and_clamped_swiglu_matches_transformers(T, dtype, device):
    g = torch.Generator().manual_seed(T)
    experts = hf_experts(g)
    x, weights, ids = routed(T, g, device)
    ref = expected(experts, x, weights, ids)
    gate_up, down = ours(experts, device)
    gate_up, down = (DenseWeight(w.weight.to(dtype), w.bias.to(dtype)) for w in (gate_up, down))
    x_dev = x.to(device, dtype)
    out = fused_moe(x_dev, gate_up, down, weights.to(device), ids.to(device), activation=ClampedSwiGLU())
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(fused_moe_reference(x_dev, gate_up, down, weights.to(device), ids.to(device),
                                                       ClampedSwiGLU()).cpu(), ref, atol=1e-4, rtol=1e-4)
    # Without the activation the output differs (the clamps and the +1 matter here).
    plain = fused_moe(x_dev, gate_up, down, weights.to(device), ids.to(device))
    assert (plain.float().cpu() - ref).abs().max() > 0.1


@pytest.mark.parametrize("T", [1, 17])
def test_cpu_backend_matches_transformers(T, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    g = torch.Generator().manual_seed(40 + T)
    with torch.device("cpu"):  # the CPU backend, whatever device the other tests run on
        experts = hf_experts(g)
        x, weights, ids = routed(T, g, "cpu")
        gate_up, down = ours(experts, "cpu")
        out = fused_moe(x, gate_up, down, weights, ids, activation=ClampedSwiGLU())
        torch.testing.assert_close(out, expected(experts, x, weights, ids), atol=1e-4, rtol=1e-4)


def test_bad_expert_bias_and_activation_raise(device):
    g = torch.Generator().manual_seed(0)
    experts = hf_experts(g)
    x, weights, ids = routed(3, g, device)
    gate_up, down = ours(experts, device)
    with pytest.raises(ValueError, match=r"gate_up bias has shape \(5, 79\); expected a contiguous \[E=5, N=80\]"):
        fused_moe(x.to(device), DenseWeight(gate_up.weight, gate_up.bias[:, 1:]), down, weights.to(device),
                  ids.to(device))
    with pytest.raises(ValueError, match="activation must be None"):
        fused_moe(x.to(device), gate_up, down, weights.to(device), ids.to(device), activation="swiglu")


# ------------------------------------------------------------------ MXFP4 experts

MX_D, MX_INTER = 96, 96  # K and N off the 64-wide tiles, multiples of the 32-element MXFP4 group


def mxfp4_experts(generator):
    """(transformers' experts on the dequantized weights, our MXFP4 gate_up / down): blocks and scales in the
    checkpoint layout (gate_up rows interleaved), dequantized for transformers by its own
    `convert_moe_packed_tensors`, handed to fused_moe as the loader does (gate rows first)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tritonq.quant.rtn import quantize_mxfp4
    from tritonq.quant.weights import MXFP4Weight

    config = GptOssConfig(hidden_size=MX_D, intermediate_size=MX_INTER, num_local_experts=E, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16)
    with torch.device("cpu"):
        experts = GptOssExperts(config)
    stored = {}
    for name, (n, k), std in (("gate_up_proj", (2 * MX_INTER, MX_D), 0.6), ("down_proj", (MX_D, MX_INTER), 0.2)):
        q = quantize_mxfp4(torch.randn(E, n, k, generator=generator, device="cpu") * std)
        bias = torch.randn(E, n, generator=generator, device="cpu") * 0.3
        with torch.no_grad():
            getattr(experts, name).copy_(convert_moe_packed_tensors(q.blocks, q.scales, dtype=torch.float32))
            getattr(experts, f"{name}_bias").copy_(bias)
        stored[name] = MXFP4Weight(q.blocks, q.scales, bias)
    order = torch.cat([torch.arange(0, 2 * MX_INTER, 2), torch.arange(1, 2 * MX_INTER, 2)])
    gate_up = stored["gate_up_proj"].take_outputs(order)
    return experts, gate_up, stored["down_proj"]


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_moe_mxfp4_matches_transformers_dequantized(T, dtype, device):
    """The MXFP4 tile decode (E8M0 scale per 32 along K; in fp16 and bf16 the word path,
    `common.mxfp4_words_to_half`) against transformers' own dequantization, through the whole gpt-oss expert MLP."""
    g = torch.Generator().manual_seed(100 + T)
    experts, gate_up, down = mxfp4_experts(g)
    x = torch.randn(T, MX_D, generator=g, device="cpu")
    weights, ids = grouped_topk(torch.randn(T, E, generator=g, device="cpu"), TOP_K, renormalize=True)
    ref = expected(experts, x, weights, ids)
    gate_up, down = (replace(w, bias=w.bias.to(dtype)).to(device) for w in (gate_up, down))
    out = fused_moe(x.to(device, dtype), gate_up, down, weights.to(device), ids.to(device),
                    activation=ClampedSwiGLU())
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref, atol=TOL[dtype] * 4, rtol=TOL[dtype])


def test_mxfp4_dequantize_matches_transformers_and_the_writer_round_trips():
    """MXFP4Weight.dequantize is transformers' dequantization (transposed to [E, N, K]); quantize_mxfp4 maps
    values already on the grid (e2m1 x a power of two per group) back to themselves exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tritonq.quant.rtn import quantize_mxfp4
    from tritonq.quant.weights import E2M1_VALUES, MXFP4Weight

    device = torch.get_default_device()  # the test's device; data drawn on the CPU (transformers' side runs there)
    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g, device="cpu")
    scales = torch.randint(100, 140, (3, 5, 4), dtype=torch.uint8, generator=g, device="cpu")
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    ours = MXFP4Weight(blocks.to(device), scales.to(device)).dequantize()
    assert ours.device == device and torch.equal(ours.cpu(), expected)
    grid = torch.tensor(E2M1_VALUES, device="cpu")[torch.randint(0, 16, (4, 64), generator=g, device="cpu")]
    grid[:, ::32] = 6.0  # each group's amax on the top of the grid: its scale is exact
    exponents = torch.randint(-8, 3, (4, 2, 1), generator=g, device="cpu").repeat_interleave(32, 1)[..., 0]
    w = torch.ldexp(grid, exponents).to(device)
    assert torch.equal(quantize_mxfp4(w).dequantize().cpu(), w.cpu())
