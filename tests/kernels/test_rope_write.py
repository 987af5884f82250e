"""rope_write_kv_slots (rope, optional qk-norm and the KV write in one Triton launch) against independent
references: rope as a complex rotation of the (i, i + D/2) pairs, the norm in float64, and the write as the
pages the slots name (untouched elsewhere).

Shapes: tokens 1, 3, 17; GQA 2 and MHA; head dims 64 and 72 (not a power of two: masked lanes), a qkv view
with strides (as a model's linear output), slots shuffled with padding (-1), 8-bit pages. Tolerances: float32,
1e-5 (a few fp32 roundings of O(1) values); int8 pages: one code (the kernel rotates in fp32 and the reference
rounds the rotation differently, which may move a value across a rounding boundary).
"""
import pytest
import torch

from tritonq.kernels.attention import QuantizedPages, dequantize_pages, rope_write_kv_slots
from tritonq.kernels.norm_rope import rope_cos_sin

PAGES, PAGE_SIZE = 8, 16


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated pairwise: (x_i, x_{i+D/2}) as a complex number times e^{i theta}, with cos / sin [T, D]
    (their first halves hold cos theta / sin theta)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    z = z * torch.complex(cos[:, None, :half].double(), sin[:, None, :half].double())
    return torch.cat([z.real, z.imag], -1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.double()


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (3, 3, 72)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_matches_rotation_and_slots(monkeypatch, tokens, heads, kv_heads, dim, qk_norm):
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    g = torch.Generator().manual_seed(tokens * 7 + dim)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim + 5, generator=g, device="cpu")
    qkv = qkv.to(torch.get_default_device())[..., :dim]  # a strided view, as a linear's output split by heads
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    cos_table, sin_table = rope_cos_sin(dim, 10000.0, 64)
    positions = torch.randint(0, 64, (tokens,), generator=g, device="cpu").to(cos_table.device)
    cos, sin = cos_table[positions], sin_table[positions]
    slots = torch.randperm(PAGES * PAGE_SIZE, generator=g, device="cpu")[:tokens]
    slots[::4] = -1  # padding rows: nothing written
    slots = slots.to(q.device)
    k_pages = torch.randn(PAGES, PAGE_SIZE, kv_heads, dim, generator=g, device="cpu").to(q.device)
    v_pages = torch.randn(PAGES, PAGE_SIZE, kv_heads, dim, generator=g, device="cpu").to(q.device)
    k_before, v_before = k_pages.clone(), v_pages.clone()
    norms = {}
    if qk_norm:
        q_norm, k_norm = torch.randn(2, dim, generator=g, device="cpu").to(q.device)
        norms = dict(q_norm=q_norm, k_norm=k_norm, eps=1e-6)
        q_in, k_in = rms(q, norms["q_norm"], 1e-6), rms(k, norms["k_norm"], 1e-6)
    else:
        q_in, k_in = q, k
    got_q = rope_write_kv_slots(q, k, v, cos, sin, k_pages, v_pages, slots, **norms)

    torch.testing.assert_close(got_q, rotate(q_in, cos, sin).float(), atol=1e-5, rtol=1e-5)
    want_k, want_v = k_before.flatten(0, 1), v_before.flatten(0, 1)
    kept = slots >= 0
    want_k[slots[kept]] = rotate(k_in, cos, sin).float()[kept]
    want_v[slots[kept]] = v[kept]
    torch.testing.assert_close(k_pages.flatten(0, 1), want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_pages.flatten(0, 1), want_v)


def test_rope_write_quantizes_into_int8_pages(monkeypatch):
    """8-bit pages: the rotated k (and v) are quantized as write_kv_slots quantizes: each stored row, dequantized,
    is within one code (its scale) of the rotated row."""
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 5, 4, 2, 64
    device = torch.get_default_device()
    q, k, v = (torch.randn(tokens, h, dim, generator=g, device="cpu").to(device) for h in (heads, kv_heads, kv_heads))
    cos_table, sin_table = rope_cos_sin(dim, 10000.0, 64)
    cos, sin = cos_table[5:5 + tokens], sin_table[5:5 + tokens]
    slots = torch.tensor([17, 3, 40, 99, 64], device=device)
    shape = (PAGES, PAGE_SIZE, kv_heads)
    k_pages, v_pages = (QuantizedPages(torch.zeros(*shape, dim, dtype=torch.int8, device=device),
                                       torch.zeros(shape, device=device)) for _ in range(2))
    rope_write_kv_slots(q, k, v, cos, sin, k_pages, v_pages, slots)
    for pages, want in ((k_pages, rotate(k, cos, sin).float()), (v_pages, v)):
        stored = dequantize_pages(pages).flatten(0, 1)[slots]
        scale = pages.scale.flatten(0, 1)[slots][..., None]
        assert ((stored - want).abs() <= scale * 1.0001).all()


def test_rope_write_refuses_mismatched_tables():
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    pages = torch.zeros(PAGES, PAGE_SIZE, 2, 64)
    with pytest.raises(ValueError, match=r"cos / sin \[T, D\] = \[3, 64\]"):
        rope_write_kv_slots(q, k, k, torch.randn(3, 32), torch.randn(3, 32), pages, pages,
                            torch.arange(3))
    with pytest.raises(ValueError, match="q_norm and k_norm"):
        rope_write_kv_slots(q, k, k, torch.randn(3, 64), torch.randn(3, 64), pages, pages, torch.arange(3),
                            q_norm=torch.ones(64))
