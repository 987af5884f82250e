"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): the causal depthwise conv with its state, the gated
delta rule (chunked prefill and recurrent decode) with its per-head state matrix, and the gated RMSNorm.

Tokens are packed: x [T, ...] holds several sequences back to back, cu_seqlens int32 [B + 1] their offsets.
Per-sequence states live in a pool: state[state_indices[b]] is sequence b's (state_indices int [B]; without it
row b), read as the state before this call and updated in place to the state after it. States are read and written
in their own dtype (the delta-rule state must be float32), activations are bf16 / fp16 / fp32, math in float32.

causal_conv1d(x [T, D], weight [D, W], bias [D] | None, conv_state [N, D, W-1], cu_seqlens, activation)
    y[t] = act(bias + sum_w weight[:, w] * x[t - (W-1) + w]), the inputs before a sequence's first token read from
    its conv state (its last W-1 inputs so far: zeros for a new sequence), which becomes the last W-1 inputs.
causal_conv1d_update(x [B, D], ...): the same for one token per sequence (decode).
chunk_gated_delta_rule(q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv], state [N, Hv, Dk, Dv], cu_seqlens, scale)
    per value head h (key head h // (Hv // Hk)), per token: q, k l2-normalized (use_qk_l2norm), q *= scale,
    S = exp(g) S;  S += k (beta (v - k^T S))^T;  o = S^T q  (transformers' torch_*_gated_delta_rule).
recurrent_gated_delta_rule(q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], state, scale): one token each.
gated_rms_norm(x [..., D], z [..., D], weight [D], eps) -> rms_norm(x) * weight * silu(z) (RMSNormGated; the
    model passes the weight it uses).

Each has a float32 torch reference here (`*_reference`: a plain conv per sequence, the recurrence token by token),
the tests' oracle. Triton kernels run on CUDA tensors (and under TRITON_INTERPRET=1); on the CPU the conv and the
decode step are the references (one small op each), the chunked rule is `chunk_gated_delta_rule_torch`, the same
chunked form as the kernel vectorized over chunks and heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tritonq.kernels import use_triton

ACTIVATIONS = (None, "silu")
CHUNK = 64  # tokens per chunk of the chunked delta rule


# ---------------------------------------------------------------------------------------------- input checks

def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"deltanet conv: activation must be one of {ACTIVATIONS}; got {activation!r}.")


def _rows_of(state: torch.Tensor, batch: int, state_indices: torch.Tensor | None, name: str) -> torch.Tensor:
    """The pool rows of the batch's sequences: state_indices, or 0..B-1 (then the state holds exactly B rows)."""
    if state_indices is None:
        if state.shape[0] != batch:
            raise ValueError(f"{name}: the state holds {state.shape[0]} rows for {batch} sequences; pass "
                             f"state_indices [{batch}] to use rows of a larger pool.")
        return torch.arange(batch, device=state.device)
    if state_indices.shape != (batch,) or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: state_indices must be int32/int64 [{batch}] (one pool row per sequence); got "
                         f"{state_indices.dtype} {tuple(state_indices.shape)}.")
    return state_indices.long()


def _check_cu_seqlens(cu_seqlens: torch.Tensor, tokens: int, name: str) -> int:
    """The number of sequences; cu_seqlens must be int32 [B + 1] (its values are the caller's: 0, ..., T)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name}: cu_seqlens must be int32 [B + 1] (sequence offsets 0, ..., T = {tokens}); got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}.")
    return cu_seqlens.shape[0] - 1


def _check_conv(x, weight, bias, conv_state, batch, name):
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"{name}: x must be [tokens, D] and weight [D, W]; got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}.")
    D, W = weight.shape
    if not 2 <= W <= 8:
        raise ValueError(f"{name}: the conv width W = {W} is outside the supported 2..8.")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"{name}: bias must be [{D}] or None; got {tuple(bias.shape)}.")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (D, W - 1):
        raise ValueError(f"{name}: conv_state must be [N, {D}, {W - 1}] (the last W-1 inputs per pool row); got "
                         f"{tuple(conv_state.shape)}.")


def _check_rule(q, k, v, g, beta, state, name):
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: q, k must be [T, Hk, Dk] and v [T, Hv, Dv] over the same tokens; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}.")
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    if Hv % Hk:
        raise ValueError(f"{name}: the value heads ({Hv}) must be a multiple of the key heads ({Hk}).")
    if g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"{name}: g and beta must be [{T}, {Hv}]; got g {tuple(g.shape)}, beta {tuple(beta.shape)}.")
    if state.dim() != 4 or state.shape[1:] != (Hv, Dk, Dv) or state.dtype != torch.float32:
        raise ValueError(f"{name}: state must be float32 [N, {Hv}, {Dk}, {Dv}]; got {state.dtype} "
                         f"{tuple(state.shape)}.")
    if Dk > 256 or Dv > 256:
        raise ValueError(f"{name}: head dims up to 256 are supported; got Dk {Dk}, Dv {Dv}.")


# ------------------------------------------------------------------------------------------------ the API

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  cu_seqlens: torch.Tensor, activation: str | None = "silu",
                  state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise conv of packed sequences, conv_state updated in place; see the module docstring."""
    _check_activation(activation)
    batch = _check_cu_seqlens(cu_seqlens, x.shape[0], "causal_conv1d")
    _check_conv(x, weight, bias, conv_state, batch, "causal_conv1d")
    rows = _rows_of(conv_state, batch, state_indices, "causal_conv1d")
    return causal_conv1d_reference(x, weight, bias, conv_state, cu_seqlens, activation, rows)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, activation: str | None = "silu",
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """causal_conv1d for one token per sequence: x [B, D] (decode)."""
    _check_activation(activation)
    _check_conv(x, weight, bias, conv_state, x.shape[0], "causal_conv1d_update")
    rows = _rows_of(conv_state, x.shape[0], state_indices, "causal_conv1d_update")
    cu_seqlens = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    return causal_conv1d_reference(x, weight, bias, conv_state, cu_seqlens, activation, rows)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, use_qk_l2norm: bool = True,
                           state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule over packed sequences (prefill), state updated in place; o [T, Hv, Dv] in v's dtype."""
    _check_rule(q, k, v, g, beta, state, "chunk_gated_delta_rule")
    batch = _check_cu_seqlens(cu_seqlens, q.shape[0], "chunk_gated_delta_rule")
    rows = _rows_of(state, batch, state_indices, "chunk_gated_delta_rule")
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, state, cu_seqlens, scale, use_qk_l2norm, rows)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, scale: float, use_qk_l2norm: bool = True,
                               state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One delta-rule step per sequence (decode): q, k [B, Hk, Dk], v [B, Hv, Dv]; o [B, Hv, Dv] in v's dtype."""
    _check_rule(q, k, v, g, beta, state, "recurrent_gated_delta_rule")
    rows = _rows_of(state, q.shape[0], state_indices, "recurrent_gated_delta_rule")
    cu_seqlens = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return gated_delta_rule_reference(q, k, v, g, beta, state, cu_seqlens, scale, use_qk_l2norm, rows)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight * silu(z) over the last dim, in x's dtype; see the module docstring."""
    if z.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"gated_rms_norm: z must match x and weight be [D]; got x {tuple(x.shape)}, z "
                         f"{tuple(z.shape)}, weight {tuple(weight.shape)}.")
    return gated_rms_norm_reference(x, z, weight, eps)


# ------------------------------------------------------------------------------------------------ references

def causal_conv1d_reference(x, weight, bias, conv_state, cu_seqlens, activation, rows) -> torch.Tensor:
    """Plain torch, float32: per sequence, its conv state then its inputs through F.conv1d; the state becomes the
    last W-1 inputs (in its dtype). rows [B]: each sequence's conv_state row."""
    D, W = weight.shape
    y = torch.empty_like(x)
    w = weight.float()[:, None, :]
    b = None if bias is None else bias.float()
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        row = int(rows[i])
        seq = torch.cat([conv_state[row].float(), x[start:end].float().T], dim=1)  # [D, W-1 + L]
        out = F.conv1d(seq[None], w, b, groups=D)[0]  # [D, L]
        y[start:end] = (F.silu(out) if activation == "silu" else out).T.to(x.dtype)
        conv_state[row] = seq[:, seq.shape[1] - (W - 1):].to(conv_state.dtype)
    return y


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (transformers' and flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """float32 q, k repeated to the value heads (value head h reads key head h // (Hv // Hk)), l2-normalized,
    q times scale; v, g, beta in float32."""
    group = v.shape[1] // q.shape[1]
    q, k = (t.float().repeat_interleave(group, dim=1) for t in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * scale, k, v.float(), g.float(), beta.float()


def gated_delta_rule_reference(q, k, v, g, beta, state, cu_seqlens, scale, use_qk_l2norm, rows) -> torch.Tensor:
    """Plain torch, float32: the recurrence token by token, all sequences' tokens at step i at once (sequence b's
    state is state[rows[b]], updated in place). o [T, Hv, Dv] in v's dtype."""
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    lengths = ends - starts
    S = state[rows].clone()  # [B, Hv, Dk, Dv]
    o = torch.zeros_like(vf)
    for i in range(int(lengths.max()) if lengths.numel() else 0):
        live = (lengths > i).nonzero()[:, 0]
        t = starts[live] + i
        s = S[live] * g[t].exp()[..., None, None]
        kt = k[t]
        delta = (vf[t] - (s * kt[..., None]).sum(-2)) * beta[t][..., None]
        s = s + kt[..., None] * delta[..., None, :]
        o[t] = (s * q[t][..., None]).sum(-2)
        S[live] = s
    state[rows] = S
    return o.to(v.dtype)


def chunk_gated_delta_rule_torch(q, k, v, g, beta, state, cu_seqlens, scale, use_qk_l2norm, rows,
                                 chunk: int = CHUNK) -> torch.Tensor:
    """The chunked (WY) form in float32 torch, per sequence (the CPU prefill path and the kernel's model):
    within a chunk of C tokens with cumulative log-decay c, L[i, j] = beta_i k_i.k_j exp(c_i - c_j) (i > j) and
    (I + L) [u | w] = [beta v | beta k exp(c)] (a unit lower-triangular solve); then per chunk, from the state S:
    v' = u - w S, o = (q exp(c)) S + tril(q k^T exp(c_i - c_j)) v', S = exp(c_C) S + (k exp(c_C - c))^T v'.
    exp is taken of differences c_i - c_j for i >= j only (masked before exp): nothing overflows."""
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    o = torch.empty_like(vf)
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    for b, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        length = end - start
        if length == 0:
            continue
        pad = -length % chunk
        n = (length + pad) // chunk

        def chunks(t):  # [L, H, ...] -> [H, n, C, ...], zero-padded (g = 0, beta = 0 there: no update)
            t = t[start:end].movedim(1, 0)
            t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 3 else F.pad(t, (0, pad))
            return t.reshape(t.shape[0], n, chunk, *t.shape[2:])

        qc, kc, vc, gc, bc = (chunks(t) for t in (qf, kf, vf, gf, bf))
        c = gc.cumsum(-1)  # [H, n, C]
        diff = (c[..., :, None] - c[..., None, :]).masked_fill(~tril, float("-inf")).exp()  # i >= j, else 0
        L = (kc * bc[..., None]) @ kc.transpose(-1, -2) * diff
        system = L.tril(-1) + torch.eye(chunk, device=q.device)
        u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kc * (bc * c.exp())[..., None], upper=False, unitriangular=True)
        attn = qc @ kc.transpose(-1, -2) * diff
        q_decayed, k_decayed = qc * c.exp()[..., None], kc * (c[..., -1:] - c).exp()[..., None]
        S = state[rows[b]].clone()  # [H, Dk, Dv]
        out = torch.empty_like(vc)
        for i in range(n):
            v_new = u[:, i] - w[:, i] @ S
            out[:, i] = q_decayed[:, i] @ S + attn[:, i] @ v_new
            S = S * c[:, i, -1].exp()[:, None, None] + k_decayed[:, i].transpose(-1, -2) @ v_new
        state[rows[b]] = S
        o[start:end] = out.reshape(out.shape[0], -1, out.shape[-1])[:, :length].movedim(0, 1)
    return o.to(v.dtype)


def gated_rms_norm_reference(x, z, weight, eps) -> torch.Tensor:
    """transformers' RMSNormGated: normalized in float32, cast to x's dtype, times weight, times silu(z) in
    float32, cast to x's dtype."""
    normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(z.float())).to(x.dtype)
