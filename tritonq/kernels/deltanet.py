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
import triton
import triton.language as tl

from tritonq.kernels import backend
from tritonq.kernels.common import Launch, upcast_dot

ACTIVATIONS = (None, "silu")
CHUNK = 64  # tokens per chunk of the chunked delta rule on the CPU (chunk_gated_delta_rule_torch)
# The Triton kernel's chunk: all of a chunk's tiles live in one program's registers, and at 64 tokens they spill
# (0.7 KB at sm_80, Dk = 128); 32 spills a few bytes (docs/kernels.md#gated-deltanet).
KERNEL_CHUNK = 32
SUB = 16  # rows of the diagonal blocks the kernel's triangular solve inverts by forward substitution
EPS_L2 = 1e-6  # l2norm's epsilon (transformers', flash-linear-attention's)


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


# ------------------------------------------------------------------------------------------------ Triton kernels

@triton.jit
def _conv_kernel(x_ptr, w_ptr, b_ptr, state_ptr, rows_ptr, cu_ptr, y_ptr, D, stride_x, stride_y, stride_w,
                 stride_sn, stride_sd, stride_sw, W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_ROWS: tl.constexpr,
                 DECODE: tl.constexpr):
    """Program (sequence, channel block): the sequence's tokens BLOCK_T at a time, each tap reading x or, before
    the sequence's first token, its conv state; then the state becomes the last W-1 inputs. Only this program
    reads or writes its state block; barriers keep every thread's reads of the old state before the writes.
    DECODE: sequence b is token b (no cu_seqlens)."""
    seq = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    if DECODE:
        start = seq.to(tl.int64)
        end = start + 1
    else:
        start = tl.load(cu_ptr + seq).to(tl.int64)
        end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    row = tl.load(rows_ptr + seq).to(tl.int64) if HAS_ROWS else seq.to(tl.int64)
    state = state_ptr + row * stride_sn + d[None, :] * stride_sd
    bias = tl.load(b_ptr + d, mask=d_ok, other=0.0).to(tl.float32) if HAS_BIAS else tl.zeros((BLOCK_D,),
                                                                                               tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        ok = (t < end)[:, None] & d_ok[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32) + bias[None, :]
        for tap in tl.static_range(W):
            p = t - (W - 1) + tap  # the input position this tap reads
            in_x = (p >= start)[:, None]
            xv = tl.load(x_ptr + p[:, None] * stride_x + d[None, :], mask=ok & in_x, other=0.0)
            sv = tl.load(state + (p - start + W - 1)[:, None] * stride_sw, mask=ok & ~in_x, other=0.0)
            wv = tl.load(w_ptr + d * stride_w + tap, mask=d_ok, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wv[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + t[:, None] * stride_y + d[None, :], acc.to(y_ptr.dtype.element_ty), mask=ok)
    j = tl.arange(0, BLOCK_W)  # the new state's column j is the input at position end - (W-1) + j
    p = end - (W - 1) + j
    in_x = (p >= start)[:, None]
    ok = (j < W - 1)[:, None] & d_ok[None, :]
    tl.debug_barrier()
    new = tl.load(x_ptr + p[:, None] * stride_x + d[None, :], mask=ok & in_x, other=0.0).to(tl.float32)
    new += tl.load(state + (p - start + W - 1)[:, None] * stride_sw, mask=ok & ~in_x, other=0.0).to(tl.float32)
    tl.debug_barrier()
    tl.store(state + j[:, None] * stride_sw, new.to(state_ptr.dtype.element_ty), mask=ok)


def conv_launch(x, weight, bias, conv_state, rows, cu_seqlens, y, activation) -> Launch:
    """The launch of _conv_kernel (cu_seqlens None: decode, one token per sequence): 64 channels x 8 tokens
    per tile, 4 warps. Over meta tensors the AOT tests compile it."""
    D, W = weight.shape
    batch = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    block_d = 64
    args = dict(x_ptr=x, w_ptr=weight, b_ptr=bias, state_ptr=conv_state, rows_ptr=rows, cu_ptr=cu_seqlens, y_ptr=y,
                D=D, stride_x=x.stride(0), stride_y=y.stride(0), stride_w=weight.stride(0),
                stride_sn=conv_state.stride(0), stride_sd=conv_state.stride(1), stride_sw=conv_state.stride(2),
                W=W, BLOCK_W=triton.next_power_of_2(W - 1), BLOCK_T=1 if cu_seqlens is None else 8,
                BLOCK_D=block_d, HAS_BIAS=bias is not None, SILU=activation == "silu", HAS_ROWS=rows is not None,
                DECODE=cu_seqlens is None)
    return Launch(_conv_kernel, (batch, triton.cdiv(D, block_d)), args, 4, 1)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, R, D, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program: BLOCK_R rows (contiguous [R, D]); y = x rstd * w * silu(z) in fp32, rounded once."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    ok = (r < R)[:, None] & (d < D)[None, :]
    at = r[:, None] * D + d[None, :]
    x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + at, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :] * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + at, y.to(y_ptr.dtype.element_ty), mask=ok)


def gated_rms_norm_launch(x, z, weight, eps, y) -> Launch:
    """The launch of _gated_rms_norm_kernel over contiguous x, z, y [R, D]: 2048 elements per program."""
    R, D = x.shape
    block_d = triton.next_power_of_2(D)
    block_r = max(1, 2048 // block_d)
    args = dict(x_ptr=x, z_ptr=z, w_ptr=weight, y_ptr=y, R=R, D=D, eps=eps, BLOCK_R=block_r, BLOCK_D=block_d)
    return Launch(_gated_rms_norm_kernel, (triton.cdiv(R, block_r),), args, 4, 1)


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, rows_ptr, o_ptr, scale,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                      stride_ot, stride_oh, stride_sn, stride_sh, stride_sk, Dk, Dv, GROUP: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, L2NORM: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Program (sequence, value head, Dv tile): one delta-rule step with the state tile [Dk, BLOCK_V] in
    registers (state rows along Dk, columns contiguous along Dv)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < Dk, vv < Dv
    row = tl.load(rows_ptr + b).to(tl.int64) if HAS_ROWS else b
    q = tl.load(q_ptr + b * stride_qt + (h // GROUP) * stride_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kt + (h // GROUP) * stride_kh + kk, mask=k_ok, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + b * stride_vt + h * stride_vh + vv, mask=v_ok, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * stride_gt + h).to(tl.float32))
    beta = tl.load(beta_ptr + b * stride_bt + h).to(tl.float32)
    at = state_ptr + row * stride_sn + h * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    ok = k_ok[:, None] & v_ok[None, :]
    S = tl.load(at, mask=ok, other=0.0) * decay
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta
    S += k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0) * scale
    tl.store(o_ptr + b * stride_ot + h * stride_oh + vv, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    tl.store(at, S, mask=ok)


@triton.jit
def _unit_lower_inverse(L, C: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):
    """(I + L)^-1 for L [C, C] strictly lower-triangular fp32. The C / SUB diagonal blocks together by forward
    substitution, a row of each block per step (row i = e_i - sum_j<i L_ij row j, the rows j final), then the
    block-triangular solve X = Xd - Xd E X, C / SUB - 1 passes (E: L below the diagonal blocks; after pass p the
    first p + 1 block rows are exact). Each step is a triangular solve's arithmetic: no power series to cancel."""
    c = tl.arange(0, C)
    eye = tl.where(c[:, None] == c[None, :], 1.0, 0.0)
    same_block = (c[:, None] // SUB) == (c[None, :] // SUB)
    diagonal = tl.where(same_block, L, 0.0)
    Xd = eye
    for i in range(1, SUB):
        Xd = tl.where((c % SUB == i)[:, None], eye - tl.dot(diagonal, Xd, input_precision=PRECISION), Xd)
    E = tl.where(same_block, 0.0, L)
    X = Xd
    for _ in range(C // SUB - 1):
        X = Xd - tl.dot(Xd, tl.dot(E, X, input_precision=PRECISION), input_precision=PRECISION)
    return X


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, rows_ptr, cu_ptr, o_ptr, scale,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                  stride_ot, stride_oh, stride_sn, stride_sh, stride_sk, Dk, Dv, GROUP: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr,
                  L2NORM: tl.constexpr, HAS_ROWS: tl.constexpr, DT: tl.constexpr):
    """Program (sequence, value head, Dv tile): the sequence's chunks of C tokens in order, the state tile
    [Dk, BLOCK_V] in registers (the chunked form of chunk_gated_delta_rule_torch). q, k stay in their dtype for
    the dots (bf16 / fp16 tensor cores); their l2 norms, beta and the decays scale the dots' rows and columns.
    The decays exp(c_i - c_j) are taken for i >= j only. DT: the dots' operand dtype (fp32: IEEE fp32 dots)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = kk < Dk, vv < Dv
    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    row = tl.load(rows_ptr + seq).to(tl.int64) if HAS_ROWS else seq.to(tl.int64)
    state = state_ptr + row * stride_sn + h * stride_sh
    S = tl.load(state + kk[:, None] * stride_sk + vv[None, :], mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    PRECISION: tl.constexpr = "ieee" if DT == tl.float32 else "tf32"
    i = tl.arange(0, C)
    causal = i[:, None] >= i[None, :]
    for t0 in range(start, end, C):
        t = t0 + i
        t_ok = t < end
        q = tl.load(q_ptr + t[:, None] * stride_qt + (h // GROUP) * stride_qh + kk[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(DT)
        k = tl.load(k_ptr + t[:, None] * stride_kt + (h // GROUP) * stride_kh + kk[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(DT)
        v = tl.load(v_ptr + t[:, None] * stride_vt + h * stride_vh + vv[None, :],
                    mask=t_ok[:, None] & v_ok[None, :], other=0.0).to(DT)
        g = tl.load(g_ptr + t * stride_gt + h, mask=t_ok, other=0.0).to(tl.float32)  # 0 past the end: c stays
        beta = tl.load(beta_ptr + t * stride_bt + h, mask=t_ok, other=0.0).to(tl.float32)
        if L2NORM:
            kf, qf = k.to(tl.float32), q.to(tl.float32)
            rk = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=1) + 1e-6)
            rq = scale / tl.sqrt(tl.sum(qf * qf, axis=1) + 1e-6)
        else:
            rk = tl.full((C,), 1.0, tl.float32)
            rq = tl.full((C,), scale, tl.float32)
        c = tl.cumsum(g, axis=0)
        c_last = tl.sum(tl.where(i == C - 1, c, 0.0), axis=0)
        decay = tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0))  # i >= j only: <= 1
        kt = tl.trans(k)
        attn = tl.where(causal, tl.dot(q, kt, input_precision=PRECISION) * (rq[:, None] * rk[None, :]) * decay,
                        0.0).to(DT)
        L = tl.dot(k, kt, input_precision=PRECISION) * ((beta * rk)[:, None] * rk[None, :]) * decay
        X = _unit_lower_inverse(tl.where(i[:, None] > i[None, :], L, 0.0), C, SUB, PRECISION)
        # v' = u - w S = X diag(beta) (v - diag(rk exp(c)) k S): w [C, Dk] is never formed
        S_dt = S.to(DT)
        rhs = v.to(tl.float32) - tl.dot(k, S_dt, input_precision=PRECISION) * (rk * tl.exp(c))[:, None]
        v_new = tl.dot((X * beta[None, :]).to(DT), rhs.to(DT), input_precision=PRECISION)
        o = tl.dot(q, S_dt, input_precision=PRECISION) * (rq * tl.exp(c))[:, None]
        o += tl.dot(attn, v_new.to(DT), input_precision=PRECISION)
        tl.store(o_ptr + t[:, None] * stride_ot + h * stride_oh + vv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & v_ok[None, :])
        k_scale = rk * tl.exp(c_last - c)
        S = S * tl.exp(c_last) + tl.dot(kt, (v_new * k_scale[:, None]).to(DT), input_precision=PRECISION)
    tl.store(state + kk[:, None] * stride_sk + vv[None, :], S, mask=k_ok[:, None] & v_ok[None, :])


def rule_launch(q, k, v, g, beta, state, rows, cu_seqlens, o, scale, use_qk_l2norm) -> Launch:
    """The launch of _chunk_kernel (cu_seqlens [B + 1]) or, cu_seqlens None, _recurrent_kernel (one token per
    sequence): one program per (sequence, value head, Dv tile). Over meta tensors the AOT tests compile it."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1:]
    chunked = cu_seqlens is not None
    block_k = max(16, triton.next_power_of_2(Dk))
    block_v = 16 if chunked else min(64, max(16, triton.next_power_of_2(Dv)))
    args = dict(q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=g, beta_ptr=beta, state_ptr=state, rows_ptr=rows, o_ptr=o,
                scale=scale, stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0),
                stride_kh=k.stride(1), stride_vt=v.stride(0), stride_vh=v.stride(1), stride_gt=g.stride(0),
                stride_bt=beta.stride(0), stride_ot=o.stride(0), stride_oh=o.stride(1), stride_sn=state.stride(0),
                stride_sh=state.stride(1), stride_sk=state.stride(2), Dk=Dk, Dv=Dv, GROUP=Hv // Hk,
                BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm, HAS_ROWS=rows is not None)
    batch = T if not chunked else cu_seqlens.shape[0] - 1
    grid = (batch, Hv, triton.cdiv(Dv, block_v))
    if not chunked:
        return Launch(_recurrent_kernel, grid, args, 4, 1)
    dt = tl.float32 if upcast_dot(v) else {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[v.dtype]
    return Launch(_chunk_kernel, grid, args | dict(cu_ptr=cu_seqlens, C=KERNEL_CHUNK, SUB=SUB, DT=dt), 8, 1)


def _inner_contiguous(*tensors):
    """Each tensor with its last dim contiguous (a view when it already is)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


# ------------------------------------------------------------------------------------------------ the API

def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  cu_seqlens: torch.Tensor, activation: str | None = "silu",
                  state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise conv of packed sequences, conv_state updated in place; see the module docstring."""
    _check_activation(activation)
    batch = _check_cu_seqlens(cu_seqlens, x.shape[0], "causal_conv1d")
    _check_conv(x, weight, bias, conv_state, batch, "causal_conv1d")
    rows = _rows_of(conv_state, batch, state_indices, "causal_conv1d")
    if backend(x) != "triton":
        return causal_conv1d_reference(x, weight, bias, conv_state, cu_seqlens, activation, rows)
    x, weight = _inner_contiguous(x, weight)
    y = torch.empty_like(x)
    conv_launch(x, weight, bias, conv_state, state_indices, cu_seqlens, y, activation)()
    return y


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, activation: str | None = "silu",
                         state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """causal_conv1d for one token per sequence: x [B, D] (decode)."""
    _check_activation(activation)
    _check_conv(x, weight, bias, conv_state, x.shape[0], "causal_conv1d_update")
    rows = _rows_of(conv_state, x.shape[0], state_indices, "causal_conv1d_update")
    if backend(x) != "triton":
        cu_seqlens = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
        return causal_conv1d_reference(x, weight, bias, conv_state, cu_seqlens, activation, rows)
    x, weight = _inner_contiguous(x, weight)
    y = torch.empty_like(x)
    conv_launch(x, weight, bias, conv_state, state_indices, None, y, activation)()
    return y


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, use_qk_l2norm: bool = True,
                           state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """The gated delta rule over packed sequences (prefill), state updated in place; o [T, Hv, Dv] in v's dtype."""
    _check_rule(q, k, v, g, beta, state, "chunk_gated_delta_rule")
    batch = _check_cu_seqlens(cu_seqlens, q.shape[0], "chunk_gated_delta_rule")
    rows = _rows_of(state, batch, state_indices, "chunk_gated_delta_rule")
    if backend(q) != "triton":
        return chunk_gated_delta_rule_torch(q, k, v, g, beta, state, cu_seqlens, scale, use_qk_l2norm, rows)
    return _rule(q, k, v, g, beta, state, state_indices, cu_seqlens, scale, use_qk_l2norm)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, scale: float, use_qk_l2norm: bool = True,
                               state_indices: torch.Tensor | None = None) -> torch.Tensor:
    """One delta-rule step per sequence (decode): q, k [B, Hk, Dk], v [B, Hv, Dv]; o [B, Hv, Dv] in v's dtype."""
    _check_rule(q, k, v, g, beta, state, "recurrent_gated_delta_rule")
    rows = _rows_of(state, q.shape[0], state_indices, "recurrent_gated_delta_rule")
    if backend(q) != "triton":
        cu_seqlens = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return gated_delta_rule_reference(q, k, v, g, beta, state, cu_seqlens, scale, use_qk_l2norm, rows)
    return _rule(q, k, v, g, beta, state, state_indices, None, scale, use_qk_l2norm)


def _rule(q, k, v, g, beta, state, state_indices, cu_seqlens, scale, use_qk_l2norm) -> torch.Tensor:
    """Launch the chunked (cu_seqlens) or the recurrent kernel; o [T, Hv, Dv] in v's dtype. The state's Dv
    axis must be contiguous (the pool's layout): it is updated in place."""
    if state.stride(-1) != 1:
        raise ValueError(f"deltanet: the state's last dim must be contiguous (it is updated in place); got strides "
                         f"{state.stride()}.")
    q, k, v, g, beta = _inner_contiguous(q, k, v, g, beta)
    q, k = q.to(v.dtype), k.to(v.dtype)
    o = torch.empty_like(v)
    rule_launch(q, k, v, g, beta, state, state_indices, cu_seqlens, o, scale, use_qk_l2norm)()
    return o


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight * silu(z) over the last dim, in x's dtype; see the module docstring."""
    if z.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"gated_rms_norm: z must match x and weight be [D]; got x {tuple(x.shape)}, z "
                         f"{tuple(z.shape)}, weight {tuple(weight.shape)}.")
    if backend(x) != "triton":
        return gated_rms_norm_reference(x, z, weight, eps)
    x2, z2 = (t.reshape(-1, t.shape[-1]).contiguous() for t in (x, z))
    y = torch.empty_like(x2)
    gated_rms_norm_launch(x2, z2, weight, eps, y)()
    return y.view(x.shape)


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
