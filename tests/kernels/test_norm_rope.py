"""rms_norm (Triton kernel, run by the interpreter, and the torch path) and rope against independent references.

Tolerances: float32 rows: 1e-5 (one reduction of <= 1000 terms); float16: 1e-3 absolute on O(1)
outputs (one fp16 rounding of the result, 2^-11 relative). Rope tables are compared with
transformers' own rope init functions in float32: 1e-5.
"""

import pytest
import torch
import tolerances
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tritonq.kernels.norm_rope import add_rms_norm, apply_rope, rms_norm, rope_cos_sin, silu_mul

TOL = tolerances.table("rms_norm")


@pytest.mark.parametrize("rows,dim", [(1, 64), (3, 100), (17, 257)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])  # the kernel (interpreted), the reference, the CPU
def test_rms_norm_matches_formula(rows, dim, dtype, backend, monkeypatch):       # backend's C loop (on a GPU: Triton)
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    if backend == "auto":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(rows, dim).to(dtype)
    w = torch.randn(dim).to(dtype)
    xf = x.double()
    expected = (xf / (xf.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()).to(dtype)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_rms_norm_rejects_wrong_weight_shape():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
             "beta_slow": 1},
}


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_tables_match_transformers(kind):
    head_dim, positions = 32, 100  # beyond max_position_embeddings, so dynamic scaling is active
    scaling = dict(ROPES[kind], rope_theta=500000.0) if ROPES[kind] else None
    config = LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=64,
                         rope_theta=500000.0, rope_scaling=scaling)
    if kind == "default":
        inv_freq, factor = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim), 1.0
    else:
        with torch.device("cpu"):  # the reference, on the host
            inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=positions)
    inv_freq = inv_freq.to(torch.get_default_device())  # our tables are made on the test's device
    angles = torch.outer(torch.arange(positions).float(), inv_freq)
    angles = torch.cat([angles, angles], -1)
    cos, sin = rope_cos_sin(head_dim, 500000.0, positions, scaling, 64)
    torch.testing.assert_close(cos, angles.cos() * factor, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, angles.sin() * factor, atol=1e-5, rtol=0)


def test_apply_rope_rotates_pairs_by_position():
    """Each (i, i + D/2) pair is rotated by angle position * inv_freq[i]: check against complex multiplication."""
    B, S, H, D = 2, 5, 3, 8
    x = torch.randn(B, S, H, D)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    cos, sin = rope_cos_sin(D, 10000.0, 16)
    z = torch.complex(x[..., :D // 2], x[..., D // 2:])
    theta = torch.outer(torch.arange(16).float(), 1.0 / 10000.0 ** (torch.arange(0, D, 2).float() / D))
    z = z * torch.polar(torch.ones_like(theta), theta)[positions][:, :, None]
    torch.testing.assert_close(apply_rope(x, cos[positions], sin[positions]), torch.cat([z.real, z.imag], -1),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows,dim", [(1, 64), (3, 100), (17, 257)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_kernel_matches_formula(rows, dim, dtype, monkeypatch):
    """The fused Triton kernel (interpreted) returns x + h as torch's addition rounds it (one rounding: exact) and
    the norm of that sum, against float64 over the rounded sum."""
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    x, h = torch.randn(rows, dim).to(dtype), torch.randn(rows, dim).to(dtype)
    w = torch.randn(dim).to(dtype)
    total, y = add_rms_norm(x, h, w, 1e-6)
    assert torch.equal(total, x + h)
    s = (x + h).double()
    expected = (s / (s.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()).to(dtype)
    torch.testing.assert_close(y, expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("rows,inter", [(1, 16), (3, 100), (17, 1500)])  # 1500: two 1024-wide blocks, a tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_kernel_matches_formula(rows, inter, dtype, monkeypatch):
    """The Triton kernel (interpreted, fp32 inside, one rounding) against float64 silu(gate) * up; a gate_up view
    with a row stride wider than 2I (a slice of a wider output) is read through its stride."""
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    wide = (torch.randn(rows, 2 * inter + 6) * 4).to(dtype)
    gate_up = wide[:, 3:3 + 2 * inter]
    g, u = gate_up.double().chunk(2, dim=-1)
    expected = (g * torch.sigmoid(g) * u).to(dtype)
    torch.testing.assert_close(silu_mul(gate_up), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_silu_mul_rejects_an_odd_width():
    with pytest.raises(ValueError, match="must be even"):
        silu_mul(torch.randn(2, 7))
