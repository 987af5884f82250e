"""Gated DeltaNet kernels (kernels/deltanet.py): the conv with its state, the chunked and recurrent gated delta
rule, the gated RMSNorm, each against transformers' Qwen3.5 torch functions (the independent reference, fp32) and
the chunked rule against the token-by-token recurrence.

Backends: "triton" runs the Triton kernels (the interpreter here, natively on a GPU), "torch" the CPU paths.
Tolerances: fp32 inputs: the chunked form reorders the recurrence's sums (a triangular solve and chunk-level dots
instead of rank-1 updates, ~130 steps of O(1) terms): 1e-4. bf16 / fp16 inputs: q, k, v rounded once as the
reference also sees them, then fp32 math, the output rounded once, plus the kernels' dots of bf16 / fp16-rounded
operands (w, the state, the attention matrix): a few bf16 ulps of O(1) outputs, 3e-2 (fp16 4e-3).
"""
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from tritonq.kernels import deltanet

LENGTHS = [1, 63, 64, 65, 130]  # one token, chunk - 1, chunk, chunk + 1, two chunks and two tokens: packed
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
BACKENDS = ["triton", "torch"]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _rule_inputs(T, Hk, Hv, Dk, Dv, dtype, pool=None):
    q, k = torch.randn(T, Hk, Dk).to(dtype), torch.randn(T, Hk, Dk).to(dtype)
    v = torch.randn(T, Hv, Dv).to(dtype)
    # the model's g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b): a range of decays, some near 1
    g = -torch.rand(Hv).mul(4).exp() * torch.nn.functional.softplus(torch.randn(T, Hv) - 2)
    beta = torch.rand(T, Hv).to(dtype)
    state = torch.randn(pool, Hv, Dk, Dv) * 0.5
    return q, k, v, g, beta, state


def _hf_recurrent(q, k, v, g, beta, state):
    """transformers' torch_recurrent_gated_delta_rule on one sequence [L, ...] (scale 1/sqrt(Dk), l2norm)."""
    o, final = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                   initial_state=state[None], output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True)
    return o[0], final[0]


@pytest.mark.parametrize("Hk,Hv", [(2, 2), (1, 2)])
def test_reference_is_transformers_recurrence(Hk, Hv):
    """The reference over packed sequences (pool rows out of order) equals transformers' recurrence per sequence."""
    lengths = [3, 1, 5]
    q, k, v, g, beta, state = _rule_inputs(sum(lengths), Hk, Hv, 8, 16, torch.float32, pool=4)
    rows = torch.tensor([2, 0, 3])
    cu = _cu(lengths)
    before = state.clone()
    o = deltanet.gated_delta_rule_reference(q, k, v, g, beta, state, cu, 8 ** -0.5, True, rows)
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_hf, final = _hf_recurrent(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], before[rows[b]])
        torch.testing.assert_close(o[s:e], o_hf, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[rows[b]], final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[1], before[1], atol=0, rtol=0)  # a row no sequence names is left alone


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", [(1, 1, 16, 32), (1, 2, 32, 16)])
def test_chunked_equals_recurrence(backend, Hk, Hv, Dk, Dv, monkeypatch):
    """Packed sequences of 1, 63, 64, 65, 130 tokens from cached states: chunk boundaries everywhere."""
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    q, k, v, g, beta, state = _rule_inputs(sum(LENGTHS), Hk, Hv, Dk, Dv, torch.float32, pool=len(LENGTHS) + 1)
    rows = torch.tensor([4, 1, 5, 0, 2], dtype=torch.int32)
    expected_state = state.clone()
    expected = deltanet.gated_delta_rule_reference(q, k, v, g, beta, expected_state, _cu(LENGTHS), Dk ** -0.5,
                                                   True, rows.long())
    o = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, _cu(LENGTHS), Dk ** -0.5, state_indices=rows)
    torch.testing.assert_close(o, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_kernel_in_half_precision(dtype, monkeypatch):
    """bf16 / fp16 q, k, v, beta (the reference sees the same rounded values): the kernel's dots of rounded
    operands stay within a few ulps of the output's dtype (module docstring)."""
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    q, k, v, g, beta, state = _rule_inputs(sum(LENGTHS), 1, 2, 32, 16, dtype, pool=len(LENGTHS))
    expected_state = state.clone()
    rows = torch.arange(len(LENGTHS))
    expected = deltanet.gated_delta_rule_reference(q, k, v, g, beta, expected_state, _cu(LENGTHS), 32 ** -0.5,
                                                   True, rows)
    o = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, _cu(LENGTHS), 32 ** -0.5)
    assert o.dtype == dtype
    torch.testing.assert_close(o.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(state, expected_state, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_with_strong_decay_stays_finite(backend, l2norm, monkeypatch):
    """g = -20 a token: exp of a chunk's cumulative decay reaches e^-1280 (a form dividing by it would overflow);
    without the l2 norm, k of norm ~sqrt(Dk) (beta small enough that the recurrence stays bounded)."""
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    T = 70
    q, k, v, g, beta, state = _rule_inputs(T, 1, 1, 16, 16, torch.float32, pool=1)
    g = torch.full((T, 1), -20.0)
    g[::7] = -0.01  # a few tokens that keep memory
    if not l2norm:
        beta = beta / 16
    expected_state = state.clone()
    expected = deltanet.gated_delta_rule_reference(q, k, v, g, beta, expected_state, _cu([T]), 0.25, l2norm,
                                                   torch.arange(1))
    o = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, _cu([T]), 0.25, use_qk_l2norm=l2norm)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    torch.testing.assert_close(o, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_split_across_calls_equals_one_call(backend, monkeypatch):
    """A 70-token prompt in one call, and as 37 then 33 tokens (a chunked prefill: the second call starts from the
    states the first left, off any chunk boundary): conv and delta rule give the same outputs and states."""
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    T, Hk, Hv, Dk, Dv, W = 70, 1, 2, 16, 16, 4
    q, k, v, g, beta, state = _rule_inputs(T, Hk, Hv, Dk, Dv, torch.float32, pool=1)
    state.zero_()
    x, weight = torch.randn(T, 2 * Hk * Dk + Hv * Dv), torch.randn(2 * Hk * Dk + Hv * Dv, W)
    conv_state = torch.zeros(1, x.shape[1], W - 1)
    split_state, split_conv = state.clone(), conv_state.clone()
    y = deltanet.causal_conv1d(x, weight, None, conv_state, _cu([T]))
    o = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, _cu([T]), 0.25)
    for part in (slice(0, 37), slice(37, T)):
        n = part.stop - part.start
        y_part = deltanet.causal_conv1d(x[part], weight, None, split_conv, _cu([n]))
        o_part = deltanet.chunk_gated_delta_rule(q[part], k[part], v[part], g[part], beta[part], split_state,
                                                 _cu([n]), 0.25)
        torch.testing.assert_close(y_part, y[part], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o_part, o[part], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(split_conv, conv_state, atol=0, rtol=0)
    torch.testing.assert_close(split_state, state, atol=1e-4, rtol=1e-4)


def test_chunked_kernel_at_head_dim_128(monkeypatch):
    """Qwen3.5's head dims (Dk = Dv = 128: several Dv tiles, the whole Dk in one tile), across a chunk boundary."""
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    lengths = [65, 3]
    q, k, v, g, beta, state = _rule_inputs(sum(lengths), 1, 1, 128, 128, torch.float32, pool=2)
    expected_state = state.clone()
    expected = deltanet.gated_delta_rule_reference(q, k, v, g, beta, expected_state, _cu(lengths), 128 ** -0.5,
                                                   True, torch.arange(2))
    o = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, _cu(lengths), 128 ** -0.5)
    torch.testing.assert_close(o, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)


def test_chunked_kernel_equals_recurrent_kernel(monkeypatch):
    """The same tokens through the chunked kernel at once and through the decode kernel one step at a time."""
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    T = 66
    q, k, v, g, beta, state = _rule_inputs(T, 1, 2, 16, 16, torch.float32, pool=1)
    stepped = state.clone()
    o = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, _cu([T]), 0.25)
    for t in range(T):
        o_t = deltanet.recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                  stepped, 0.25)
        torch.testing.assert_close(o_t[0], o[t], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, stepped, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_step_matches_transformers(backend, dtype, monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    B, Hk, Hv, Dk, Dv = 3, 1, 2, 16, 32
    q, k, v, g, beta, state = _rule_inputs(B, Hk, Hv, Dk, Dv, dtype, pool=B)
    before = state.clone()
    o = deltanet.recurrent_gated_delta_rule(q, k, v, g, beta, state, Dk ** -0.5)
    for b in range(B):
        o_hf, final = _hf_recurrent(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], before[b])
        torch.testing.assert_close(o[b].float(), o_hf[0].float(), atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(state[b], final, atol=1e-5, rtol=1e-5)


def _hf_conv(x, weight, bias, state, activation):
    """transformers' conv over [state | x] (torch fallback of causal_conv1d_update, seq_len = len(x))."""
    hf_state = torch.cat([torch.zeros(x.shape[1], 1), state.float()], dim=1)[None]  # its state keeps W inputs
    y = hf.causal_conv1d_update(x.T[None].float(), hf_state, weight.float(), None if bias is None else bias.float(),
                                activation=activation)
    return y[0].T, hf_state[0, :, 1:]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W,bias,activation", [(4, False, "silu"), (3, True, None)])
def test_causal_conv1d_matches_transformers(backend, dtype, W, bias, activation, monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    lengths, D = [1, 2, 7, 33], 40
    x = torch.randn(sum(lengths), D).to(dtype)
    weight = torch.randn(D, W).to(dtype)
    b = torch.randn(D).to(dtype) if bias else None
    conv_state = torch.randn(6, D, W - 1).to(dtype)
    rows = torch.tensor([5, 0, 3, 1])
    before = conv_state.clone()
    y = deltanet.causal_conv1d(x, weight, b, conv_state, _cu(lengths), activation, state_indices=rows)
    cu = _cu(lengths)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_hf, state_hf = _hf_conv(x[s:e].float(), weight, b, before[rows[i]], activation)
        torch.testing.assert_close(y[s:e].float(), y_hf, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(conv_state[rows[i]].float(), state_hf, atol=0, rtol=0)  # inputs, moved
    for untouched in (2, 4):
        torch.testing.assert_close(conv_state[untouched], before[untouched], atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_conv1d_update_matches_transformers(backend, monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    B, D, W = 3, 24, 4
    x, weight, bias = torch.randn(B, D), torch.randn(D, W), torch.randn(D)
    conv_state = torch.randn(B, D, W - 1)
    before = conv_state.clone()
    y = deltanet.causal_conv1d_update(x, weight, bias, conv_state)
    for b in range(B):
        y_hf, state_hf = _hf_conv(x[b:b + 1], weight, bias, before[b], "silu")
        torch.testing.assert_close(y[b:b + 1], y_hf, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state[b], state_hf, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(backend, dtype, monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", backend)
    rows, D = 5, 48
    norm = hf.Qwen3_5RMSNormGated(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D))
    x, z = torch.randn(rows, 3, D).to(dtype), torch.randn(rows, 3, D).to(dtype)
    with torch.no_grad():
        expected = norm(x, z)
    torch.testing.assert_close(deltanet.gated_rms_norm(x, z, norm.weight.detach(), 1e-6), expected,
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_inputs_are_refused_before_any_work():
    q, k, v, g, beta, state = _rule_inputs(4, 2, 3, 8, 8, torch.float32, pool=1)
    cu = _cu([4])
    with pytest.raises(ValueError, match=r"value heads \(3\) must be a multiple of the key heads \(2\)"):
        deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, cu, 1.0)
    q, k, v, g, beta, state = _rule_inputs(4, 1, 2, 8, 8, torch.float32, pool=3)
    with pytest.raises(ValueError, match="pass state_indices"):
        deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, cu, 1.0)
    with pytest.raises(ValueError, match="state must be float32"):
        deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state.half(), cu, 1.0, state_indices=torch.tensor([0]))
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        deltanet.chunk_gated_delta_rule(q, k, v, g, beta, state, cu.long(), 1.0, state_indices=torch.tensor([0]))
    with pytest.raises(ValueError, match="conv_state must be"):
        deltanet.causal_conv1d(torch.randn(4, 6), torch.randn(6, 4), None, torch.zeros(1, 6, 4), cu)
    with pytest.raises(ValueError, match="activation must be"):
        deltanet.causal_conv1d_update(torch.randn(1, 6), torch.randn(6, 4), None, torch.zeros(1, 6, 3), "gelu")
