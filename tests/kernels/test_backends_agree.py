"""One harness per op the runtime dispatches: every backend this machine has runs the op on the same odd-shaped
inputs, and each result is compared with a float32 reference written here (not the kernels' own references) at
the dtype's tolerance (tests/tolerances.py).

Backends, chosen where kernels/__init__.py chooses them (the environment, read per call): `triton` (the @triton.jit
kernels: natively on a GPU, in Triton's interpreter on the CPU), `cpu` (the CPU backend: CPU tensors without
TRITON_INTERPRET, the C loops of kernels/cpu/csrc and torch's CPU kernels), `torch` (TRITONQ_BACKEND=torch, the
plain torch paths). Ops go through their public functions and the linear table (`kind_of(w)`: prepare once, run),
so the harness holds whichever backend decision the runtime makes.
"""
import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F
import tolerances
from formats.helpers import dequantize as dequantize_int4

from tritonq.kernels.attention import decode_attention, paged_prefill_attention
from tritonq.kernels.linear import kind_of
from tritonq.kernels.moe import fused_moe
from tritonq.kernels.norm_rope import add_rms_norm, apply_rope, rms_norm, silu_mul
from tritonq.quant.rtn import quantize_fp8, quantize_int4, quantize_w8a8
from tritonq.quant.weights import DenseWeight, stack_experts

CUDA = torch.cuda.is_available()
BACKENDS = ["triton", "cpu", "torch"]
ROWS = [1, 3, 17]  # tokens: decode, a small batch, past a 16-row tile
K, N = 96, 40  # off the 32 / 64 tiles; K a multiple of the int4 group
EPS = 1e-6


def int4_dtype(request) -> torch.dtype:
    """The dtype whose tolerance an int4 GEMM meets: the CPU backend's int4 kernel (torch's, kernels/cpu/lowbit.py)
    takes bf16 activations and scales, so bf16's; float32 elsewhere."""
    return torch.bfloat16 if request.node.callspec.params["backend"] == "cpu" else torch.float32


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> torch.device:
    """Selects one backend for the test; returns the device its tensors go on."""
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    if request.param == "torch":
        monkeypatch.setenv("TRITONQ_BACKEND", "torch")
        return torch.device("cpu")
    if request.param == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        return torch.device("cpu")
    if CUDA and "TRITON_INTERPRET" not in os.environ:
        return torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # conftest's setting without a GPU
    return torch.device("cpu")


def randn(*shape, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Random values drawn on the CPU, the same for every backend."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * seed + math.prod(shape))) * scale


def assert_agrees(got: torch.Tensor, want: torch.Tensor, tol: float, relative_to_max: bool = False) -> None:
    """got (any device and dtype) within tol of the float32 reference: rtol and atol tol, or atol tol * max|want|
    for outputs that cancel to near zero (the GEMMs, as tests/tolerances.py says)."""
    atol = tol * want.abs().max().item() if relative_to_max else tol
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=atol)


# ---- linears: one table of weight types (kernels/linear.py) -------------------------------------------------------

def dense_of_fp8(w) -> torch.Tensor:
    s = w.weight_scale.float()
    if w.block_size is not None:
        bn, bk = w.block_size
        s = s.repeat_interleave(bn, 0)[:w.weight.shape[0]].repeat_interleave(bk, 1)[:, :w.weight.shape[1]]
    return w.weight.float() * s


def weight_only(w):
    """FP8 weights as a weight-only checkpoint: activations unrounded on every backend. (With dynamic activation
    scales the backends differ by design: the CPU backend runs FP8 weight-only unless told, kernels/fp8_gemm.py.)"""
    return dataclasses.replace(w, weight_only=True)


def w8a8_reference(x: torch.Tensor, w) -> torch.Tensor:
    """Activations quantized per token (absmax / 127.5, round half to even), int8 codes times their scales."""
    scale = x.abs().amax(dim=1, keepdim=True) / 127.5
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    xq = torch.round((x / scale).clamp(-128, 127))
    return (xq * scale) @ (w.weight.float() * w.weight_scale.float()).T


LINEARS = {  # name: (weight from a float [N, K] matrix, float32 reference y(x, weight), tolerances family)
    "dense": (lambda w: DenseWeight(w), lambda x, w: x @ w.weight.T, "fp8_gemm"),
    "int4_awq_g32": (lambda w: quantize_int4(w, group_size=32), lambda x, w: x @ dequantize_int4(w).T, "int4_gemm"),
    "int4_gptq_sym": (lambda w: quantize_int4(w, group_size=32, sym=True), lambda x, w: x @ dequantize_int4(w).T,
                      "int4_gemm"),
    "fp8_channel": (lambda w: weight_only(quantize_fp8(w, "channel")), lambda x, w: x @ dense_of_fp8(w).T,
                    "fp8_gemm"),
    "fp8_block": (lambda w: weight_only(quantize_fp8(w, "block", (32, 32))), lambda x, w: x @ dense_of_fp8(w).T,
                  "fp8_gemm"),
    "w8a8_channel": (quantize_w8a8, w8a8_reference, "int8_gemm"),
}


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("name", list(LINEARS))
def test_linear(backend, name, M, request):
    make, reference, family = LINEARS[name]
    dtype = int4_dtype(request) if family == "int4_gemm" else torch.float32
    weight = make(randn(N, K, scale=0.1))
    x = randn(M, K)
    kind = kind_of(weight)
    y = kind.run(x.to(backend), kind.prepare(weight.to(backend)))
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert_agrees(y, reference(x, weight), tolerances.TOLERANCE[dtype][family], relative_to_max=True)


# ---- norms and the MLP activation ---------------------------------------------------------------------------------

def rms_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()).float()


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("D", [40, 130])
def test_rms_norm(backend, M, D):
    x, weight = randn(M, D), randn(D)
    y = rms_norm(x.to(backend), weight.to(backend), EPS)
    assert_agrees(y, rms_reference(x, weight), tolerances.TOLERANCE[torch.float32]["rms_norm"])


@pytest.mark.parametrize("M", ROWS)
def test_residual_add_rms_norm(backend, M):
    D = 130
    x, h, weight = randn(M, D), randn(M, D, scale=0.5), randn(D)
    total, y = add_rms_norm(x.to(backend), h.to(backend), weight.to(backend), EPS)
    assert_agrees(total, x + h, 0)  # one fp32 addition, as torch's
    assert_agrees(y, rms_reference(x + h, weight), tolerances.TOLERANCE[torch.float32]["rms_norm"])


@pytest.mark.parametrize("M", ROWS)
def test_silu_mul(backend, M):
    inter = 72
    gate_up = randn(M, 2 * inter)
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert_agrees(silu_mul(gate_up.to(backend)), want, 2 ** -20)  # exp and one product in fp32


@pytest.mark.parametrize("S", ROWS)
def test_rope(backend, S):
    B, H, D = 2, 3, 24
    x = randn(B, S, H, D)
    angles = randn(B, S, D // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    first, second = x[..., :D // 2], x[..., D // 2:]  # NeoX halves: (a, b) -> (a cos - b sin, b cos + a sin)
    c, s = angles.cos()[:, :, None], angles.sin()[:, :, None]
    want = torch.cat([first * c - second * s, second * c + first * s], -1)
    assert_agrees(apply_rope(x.to(backend), cos.to(backend), sin.to(backend)), want, 2 ** -20)


# ---- paged attention ---------------------------------------------------------------------------------------------

PAGE, HEADS, KV_HEADS, HEAD_DIM = 16, 4, 2, 24
CACHE_LENS = [1, 19, 40]  # one key, past a page, past two


def paged(lens: list[int]):
    """Each sequence's keys / values [len, Hkv, D] and the same written to interleaved pages (never contiguous)."""
    per_seq = max(-(-n // PAGE) for n in lens)
    block_table = torch.tensor([[b + len(lens) * i for i in range(per_seq)] for b in range(len(lens))],
                               dtype=torch.int32)
    k_pages = randn(len(lens) * per_seq, PAGE, KV_HEADS, HEAD_DIM)
    v_pages = randn(len(lens) * per_seq, PAGE, KV_HEADS, HEAD_DIM)
    keys = [k_pages[block_table[b]].flatten(0, 1)[:n] for b, n in enumerate(lens)]
    values = [v_pages[block_table[b]].flatten(0, 1)[:n] for b, n in enumerate(lens)]
    return k_pages, v_pages, block_table, keys, values


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int, scale: float) -> torch.Tensor:
    """q [T, H, D] at positions first_position.. against k, v [n, Hkv, D], causal, GQA: [T, H, D]."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,nhd->htn", q, k) * scale
    positions = torch.arange(first_position, first_position + q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), v)


def test_decode_attention(backend):
    k_pages, v_pages, block_table, keys, values = paged(CACHE_LENS)
    q = randn(len(CACHE_LENS), HEADS, HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    got = decode_attention(q.to(backend), k_pages.to(backend), v_pages.to(backend),
                           torch.tensor(CACHE_LENS, dtype=torch.int32, device=backend), block_table.to(backend), scale)
    want = torch.cat([attend(q[b:b + 1], keys[b], values[b], n - 1, scale) for b, n in enumerate(CACHE_LENS)])
    assert_agrees(got, want, tolerances.TOLERANCE[torch.float32]["attention"])


def test_paged_prefill_attention(backend):
    """New tokens after a cached prefix (the last q_len of each sequence's keys), packed varlen."""
    q_lens = [1, 17, 3]
    k_pages, v_pages, block_table, keys, values = paged(CACHE_LENS)
    q = randn(sum(q_lens), HEADS, HEAD_DIM)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = HEAD_DIM ** -0.5
    got = paged_prefill_attention(q.to(backend), k_pages.to(backend), v_pages.to(backend), cu.to(backend),
                                  torch.tensor(CACHE_LENS, dtype=torch.int32, device=backend),
                                  block_table.to(backend), scale)
    want = torch.cat([attend(q[cu[b]:cu[b + 1]], keys[b], values[b], n - q_lens[b], scale)
                      for b, n in enumerate(CACHE_LENS)])
    assert_agrees(got, want, tolerances.TOLERANCE[torch.float32]["attention"])


# ---- MoE experts ---------------------------------------------------------------------------------------------------

EXPERTS, TOP_K, D_MODEL, D_INTER = 5, 2, 64, 32


@pytest.mark.parametrize("T", ROWS)
@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_moe_experts(backend, kind, T, request):
    make = DenseWeight if kind == "dense" else (lambda w: quantize_int4(w, group_size=32))
    gate_up = [make(randn(2 * D_INTER, D_MODEL, scale=0.2, seed=e)) for e in range(EXPERTS)]
    down = [make(randn(D_MODEL, D_INTER, scale=0.2, seed=e)) for e in range(EXPERTS)]
    dense = (lambda w: w.weight) if kind == "dense" else dequantize_int4
    x = randn(T, D_MODEL)
    topk_ids = torch.stack([torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(t))[:TOP_K]
                            for t in range(T)]).to(torch.int32)
    topk_weights = randn(T, TOP_K).softmax(-1)
    want = torch.zeros(T, D_MODEL)
    for t in range(T):
        for j in range(TOP_K):
            e = int(topk_ids[t, j])
            h = dense(gate_up[e]) @ x[t]
            want[t] += topk_weights[t, j] * (dense(down[e]) @ (F.silu(h[:D_INTER]) * h[D_INTER:]))
    got = fused_moe(x.to(backend), stack_experts(gate_up).to(backend), stack_experts(down).to(backend),
                    topk_weights.to(backend), topk_ids.to(backend))
    dtype = int4_dtype(request) if kind == "int4" else torch.float32
    assert_agrees(got, want, tolerances.TOLERANCE[dtype]["moe"], relative_to_max=True)
