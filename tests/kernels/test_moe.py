"""MoE routing, token alignment and the fused expert GEMM against independent references.

Tolerances (stated once): fp32 activations -> the kernel and the float32 loop reference differ
only in summation order: rtol/atol 1e-4. fp16 activations -> the kernel rounds x, the dequantized
weights and the SiLU-and-mul hidden to fp16 (11-bit mantissa) before each GEMM: 2e-2; bf16
(8-bit mantissa, 8x coarser than fp16): 5e-2. W8A8 fp8 experts (fp32 activations): kernel and reference quantize
the same inputs identically and products of e4m3 values are exact in fp32: summation order only, 1e-4.
Routing: grouped_topk exactly (same fp32 torch ops as its reference, deterministic tie rule); route_tokens' kernel
ids exactly, its weights within ROUTE_RTOL: the softmax's row sum over E <= 256 terms in another order (at most
255 * 2^-24 ~ 1.5e-5 relative, ~1e-6 in practice) and the GPU's exp / sigmoid / division approximations (a few ulps).
"""
import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import tolerances

from tritonq.kernels import common, moe
from tritonq.kernels.moe import (
    fused_moe,
    fused_moe_reference,
    grouped_topk,
    grouped_topk_reference,
    moe_align_block_size,
    route_tokens,
)
from tritonq.quant.packing import pack_int32
from tritonq.quant.rtn import quantize_mxfp4
from tritonq.quant.weights import DenseWeight, FP8Weight, Int4Weight, MXFP4Weight

TOL = tolerances.table("moe")
ROUTE_RTOL = 2e-5


# ------------------------------------------------------------------ routing

def _logits(T, E, n_group, kind):
    if kind == "random":
        return torch.randn(T, E)
    if kind == "ties":  # few distinct values: many experts tie within and across groups
        return torch.randint(0, 3, (T, E)).float()
    # every group a copy of the first: all group scores equal
    return torch.randn(T, E // n_group).repeat(1, n_group)


ROUTING_CASES = [  # (E, top_k, n_group, topk_group, scoring, with_bias, renormalize, rsf)
    (8, 2, 1, 1, "softmax", False, False, 1.0),        # Mixtral-like greedy
    (64, 6, 1, 1, "softmax", False, False, 1.0),       # DeepSeek-V2-Lite greedy
    (64, 6, 4, 2, "sigmoid", True, True, 2.5),         # noaux_tc, 4 groups
    (160, 6, 8, 3, "softmax", False, False, 16.0),     # DeepSeek-V2 group_limited_greedy
    (160, 8, 8, 4, "sigmoid", True, True, 2.5),        # DeepSeek-V3-like noaux_tc
    (8, 3, 8, 4, "softmax", False, True, 1.0),         # one expert per group
]


@pytest.mark.parametrize("kind", ["random", "ties", "equal_groups"])
@pytest.mark.parametrize("E,top_k,n_group,topk_group,scoring,with_bias,renormalize,rsf", ROUTING_CASES)
def test_grouped_topk_matches_reference(kind, E, top_k, n_group, topk_group, scoring, with_bias, renormalize, rsf):
    logits = _logits(17, E, n_group, kind)
    bias = torch.randint(0, 4, (E,)).float() * 0.25 if with_bias else None  # coarse: keeps ties
    args = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, scoring=scoring,
                correction_bias=bias, renormalize=renormalize, routed_scaling_factor=rsf)
    weights, ids = grouped_topk(logits, **args)
    ref_weights, ref_ids = grouped_topk_reference(logits, **args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    assert torch.equal(weights, ref_weights)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_grouped_topk_matches_transformers_router(method):
    """Tie-free random logits: the same experts and weights as transformers' DeepSeek routers."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2TopkRouter,
    )
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3TopkRouter,
    )
    E, hidden, top_k, n_group, topk_group = 64, 16, 6, 8, 3
    common = dict(hidden_size=hidden, n_routed_experts=E, num_experts_per_tok=top_k, n_group=n_group,
                  topk_group=topk_group, routed_scaling_factor=2.5, num_attention_heads=2,
                  num_key_value_heads=2)
    if method == "noaux_tc":
        router = DeepseekV3TopkRouter(DeepseekV3Config(norm_topk_prob=True, **common))
        router.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
        args = dict(n_group=n_group, topk_group=topk_group, scoring="sigmoid",
                    correction_bias=router.e_score_correction_bias, renormalize=True)
    else:
        router = DeepseekV2TopkRouter(DeepseekV2Config(topk_method=method, **common))
        args = dict(n_group=n_group, topk_group=topk_group) if method == "group_limited_greedy" else {}
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, hidden))
        x = torch.randn(17, hidden)
        logits, hf_weights, hf_ids = router(x)
    weights, ids = grouped_topk(logits, top_k, routed_scaling_factor=2.5, **args)
    hf_order = hf_ids.sort(-1).indices  # transformers returns its top-k unsorted
    ours_order = ids.long().sort(-1).indices
    assert torch.equal(ids.long().gather(1, ours_order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, ours_order), hf_weights.gather(1, hf_order))


def _route(logits, top_k, **args):
    """route_tokens' routing (its Triton kernel on the Triton backend), no alignment."""
    return route_tokens(logits, top_k, **args, block_m=None)[:2]


@pytest.mark.parametrize("router", [grouped_topk, _route], ids=["grouped_topk", "route_tokens"])
def test_grouped_topk_ties_pick_lowest_index(router):
    logits = torch.zeros(2, 8)
    _, ids = router(logits, top_k=2)
    assert ids.tolist() == [[0, 1], [0, 1]]
    # 4 groups of 2, all equal: groups 0 and 1 are kept, then experts 0..3 in order
    _, ids = router(logits, top_k=3, n_group=4, topk_group=2)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.parametrize("router", [grouped_topk, _route], ids=["grouped_topk", "route_tokens"])
def test_grouped_topk_bias_selects_but_does_not_weight(router):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    weights, ids = router(logits, top_k=2, scoring="sigmoid", correction_bias=bias)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[0.0, 3.0]])))


def test_grouped_topk_rejects_bad_groups():
    with pytest.raises(ValueError, match="n_group"):
        grouped_topk(torch.randn(2, 10), top_k=2, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="top_k"):
        grouped_topk(torch.randn(2, 8), top_k=3, n_group=4, topk_group=1)


# ------------------------------------------------------------------ routing and alignment in one launch

ROUTE_CASES = [  # (E, top_k, n_group, topk_group, scoring, with_bias, renormalize, rsf)
    (8, 1, 1, 1, "softmax", False, False, 1.0),        # top-1
    (8, 2, 1, 1, "softmax", False, True, 1.0),         # Mixtral / gpt-oss: the top-k logits softmaxed
    (8, 8, 1, 1, "sigmoid", False, True, 1.0),         # every expert chosen
    (64, 8, 1, 1, "softmax", False, True, 1.0),        # Qwen3-MoE-like
    (64, 6, 8, 3, "softmax", False, False, 16.0),      # DeepSeek-V2 group_limited_greedy
    (64, 2, 1, 1, "sigmoid", True, False, 1.0),        # sigmoid + bias, one group
    (128, 8, 8, 4, "sigmoid", True, True, 2.5),        # DeepSeek-V3 / GLM-4.5 noaux_tc
    (128, 1, 4, 1, "softmax", True, True, 1.0),        # softmax + bias: groups scored by their best two
]


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("kind", ["random", "ties", "equal_groups"])
@pytest.mark.parametrize("E,top_k,n_group,topk_group,scoring,with_bias,renormalize,rsf", ROUTE_CASES)
def test_route_tokens_matches_reference_and_alignment(monkeypatch, T, kind, E, top_k, n_group, topk_group, scoring,
                                                      with_bias, renormalize, rsf):
    """The routing kernel against the per-token reference (ties to the lower index), and its alignment (in the same
    program up to ALIGN_ONE_PROGRAM, e.g. 64 tokens of top-1; torch's scans past it) equal to moe_align_block_size's
    torch scans over the reference ids."""
    logits = _logits(T, E, n_group, kind)
    bias = torch.randint(0, 4, (E,)).float() * 0.25 if with_bias else None  # coarse: keeps ties
    args = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, scoring=scoring,
                correction_bias=bias, renormalize=renormalize, routed_scaling_factor=rsf)
    block_m = 16 if T < 17 else 64
    weights, ids, alignment = route_tokens(logits, **args, block_m=block_m)
    ref_weights, ref_ids = grouped_topk_reference(logits, **args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=ROUTE_RTOL, atol=0.0)
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    for got, want in zip(alignment, moe_align_block_size(ref_ids, block_m, E)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("T", [3, 64])
def test_route_tokens_over_the_experts_a_rank_holds(monkeypatch, T):
    """Expert parallelism: experts 16..47 of 64 held here; the others' slots are -1 and sort after the counted rows
    (the kernel, then the same through grouped_topk and the torch scans on the torch backend)."""
    first, held = 16, 32
    logits = torch.randn(T, 64)
    args = dict(top_k=8, n_group=8, topk_group=4, scoring="sigmoid", correction_bias=torch.randn(64) * 0.1,
                renormalize=True, routed_scaling_factor=2.5)
    ref_weights, ref_ids = grouped_topk_reference(logits, **args)
    local = ref_ids - first
    expected = torch.where((local >= 0) & (local < held), local, -1)
    assert bool((expected == -1).any()) and bool((expected >= 0).any())
    for backend in ("triton", "torch"):
        monkeypatch.setenv("TRITONQ_BACKEND", backend)
        weights, ids, alignment = route_tokens(logits, **args, block_m=16, num_experts=held, first_expert=first)
        assert torch.equal(ids, expected), backend
        torch.testing.assert_close(weights, ref_weights, rtol=ROUTE_RTOL, atol=0.0)
        for got, want in zip(alignment, moe_align_block_size(expected, 16, held)):
            assert torch.equal(got, want), backend


def test_route_rows_do_not_depend_on_the_batch():
    """A row routed alone (one program, aligned in it) and among 64 (a grid of programs, aligned by torch's scans
    after it): the same weights bit for bit, as the batch-invariant mode needs."""
    logits = torch.randn(64, 256)
    args = dict(top_k=8, n_group=8, topk_group=4, scoring="sigmoid", correction_bias=torch.randn(256) * 0.1,
                renormalize=True, routed_scaling_factor=2.5)
    weights, ids, _ = route_tokens(logits, **args, block_m=16)
    for t in (0, 37, 63):
        one_weights, one_ids, _ = route_tokens(logits[t:t + 1], **args, block_m=16)
        assert torch.equal(one_ids[0], ids[t]) and torch.equal(one_weights[0], weights[t])


def test_route_tokens_rejects_bad_inputs():
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"held experts \[4, 12\) must lie in the router's 8 experts"):
        route_tokens(logits, 2, block_m=16, num_experts=8, first_expert=4)
    with pytest.raises(ValueError, match="block_m=24 must be a power of two"):
        route_tokens(logits, 2, block_m=24)
    with pytest.raises(ValueError, match="n_group"):
        route_tokens(torch.randn(2, 10), 2, n_group=4, block_m=16)
    elsewhere = torch.device("meta") if logits.device.type != "meta" else torch.device("cpu")
    with pytest.raises(ValueError, match="correction_bias is on"):
        route_tokens(logits, 2, scoring="sigmoid", correction_bias=torch.zeros(8, device=elsewhere), block_m=16)


# ------------------------------------------------------------------ alignment

@pytest.fixture(params=["triton", "torch"])
def align_backend(request, monkeypatch):
    """moe_align_block_size's one-launch Triton kernel (interpreted on CPU) and its torch scans."""
    monkeypatch.setenv("TRITONQ_BACKEND", request.param)
    return request.param


def check_alignment(ids, block_m, E, sorted_ids, expert_ids, post_padded):
    """The alignment's definition, checked on the host: each expert's pairs (ids >= 0) fill consecutive block_m
    blocks from a padded start, in token order, padded with the sentinel T * k; num_tokens_post_padded counts
    those blocks; every pair appears once (the -1 ones after the counted rows)."""
    ids, sorted_ids, expert_ids = ids.cpu(), sorted_ids.cpu(), expert_ids.cpu()
    numel, flat = ids.numel(), ids.flatten().long()
    counts = torch.stack([(flat == e).sum() for e in range(E)])
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(post_padded) == int(padded.sum())
    start = 0
    for e in range(E):
        run = sorted_ids[start:start + int(padded[e])]
        assert run[:int(counts[e])].tolist() == torch.nonzero(flat == e).flatten().tolist()  # token order
        assert bool((run[int(counts[e]):] == numel).all())
        assert bool((expert_ids[start // block_m:(start + int(padded[e])) // block_m] == e).all())
        start += int(padded[e])
    assert sorted(sorted_ids[start:][sorted_ids[start:] < numel].tolist()) == torch.nonzero(flat < 0).flatten().tolist()
    assert sorted(sorted_ids[sorted_ids < numel].tolist()) == list(range(numel))


def test_align_groups_pairs_by_expert_and_pads_runs(align_backend):
    E, block_m = 6, 4
    ids = torch.tensor([[0, 2], [2, 5], [0, 2], [5, 0], [2, 2]], dtype=torch.int32)  # experts 1, 3, 4 empty
    sorted_ids, expert_ids, post_padded = moe_align_block_size(ids, block_m, E)
    assert int(post_padded) == 4 + 8 + 4  # expert 0: 3 pairs, expert 2: 5 pairs, expert 5: 2 pairs
    check_alignment(ids, block_m, E, sorted_ids, expert_ids, post_padded)


@pytest.mark.parametrize("T,top_k,E,block_m", [(1, 6, 64, 16), (33, 6, 64, 16), (200, 2, 8, 32), (3, 8, 256, 16)])
@pytest.mark.parametrize("dropped", [False, True])
def test_align_random_routing_covers_every_pair_once(align_backend, T, top_k, E, block_m, dropped):
    """Random routings (DeepSeek-V3's 256 experts among them); dropped: a third of the slots are -1 (experts of other
    ranks), which come after the counted rows."""
    g = torch.Generator().manual_seed(T * E + top_k)
    ids = torch.stack([torch.randperm(E, generator=g, device="cpu")[:top_k] for _ in range(T)]).to(torch.int32)
    if dropped:
        ids[torch.rand(T, top_k, generator=g, device="cpu") < 0.33] = -1
    ids = ids.to(torch.get_default_device())
    sorted_ids, expert_ids, post_padded = moe_align_block_size(ids, block_m, E)
    check_alignment(ids, block_m, E, sorted_ids, expert_ids, post_padded)


# ------------------------------------------------------------------ fused MoE

def _stacked(kind, E, N, K, group_size=None):
    """(stacked typed weight, its dense fp32 [E, N, K] built straight from the generated values); group_size: the
    int kinds' own unless given."""
    if kind == "dense":
        w = torch.randn(E, N, K) / K ** 0.5
        return DenseWeight(w), w
    if kind.startswith("int"):
        # int4: group 16 (several groups per K tile); int4_sym: group 64 = BLOCK_K (one scale row per K tile);
        # int4_act_order: a shuffled g_idx per expert; int8: bits 8, group 8
        bits = 8 if kind == "int8" else 4
        group_size = group_size or {"int4_sym": 64, "int8": 8}.get(kind, 16)
        G = -(-K // group_size)
        q = torch.randint(0, 2 ** bits, (E, K, N), dtype=torch.int32)
        scales = (torch.rand(E, G, N) * 0.02 + 0.01).half()
        zeros = None if kind == "int4_sym" else torch.randint(0, 2 ** bits, (E, G, N)).half()
        group = (torch.arange(K) // group_size).expand(E, K)
        g_idx = None
        if kind == "int4_act_order":
            group = torch.stack([group[e][torch.randperm(K)] for e in range(E)])
            g_idx = group.to(torch.int32)
        z = 2.0 ** (bits - 1) if zeros is None else torch.stack([zeros[e].float()[group[e]] for e in range(E)])
        s = torch.stack([scales[e].float()[group[e]] for e in range(E)])
        dense = ((q.float() - z) * s).transpose(1, 2)
        return Int4Weight(pack_int32(q, bits, dim=1), scales, zeros, g_idx, group_size, bits), dense
    w8 = (torch.randn(E, N, K) * 2).to(torch.float8_e4m3fn)
    if kind == "fp8_tensor":
        s = torch.rand(E) * 0.1 + 0.05
        return FP8Weight(w8, s), w8.float() * s[:, None, None]
    if kind == "fp8_channel":
        s = torch.rand(E, N, 1) * 0.1 + 0.05
        return FP8Weight(w8, s), w8.float() * s
    # fp8_block: blocks narrower than BLOCK_K (scale gathered per element); fp8_block64: one per tile
    bn, bk = (16, 32) if kind == "fp8_block" else (16, 64)
    s = torch.rand(E, -(-N // bn), -(-K // bk)) * 0.1 + 0.05
    full = s.repeat_interleave(bn, 1)[:, :N].repeat_interleave(bk, 2)[:, :, :K]
    return FP8Weight(w8, s, block_size=(bn, bk)), w8.float() * full


def _per_token_moe(x, gate_up, down, weights, ids):
    """Independent dense reference: one token and one slot at a time."""
    inter = down.shape[2]
    out = torch.zeros(x.shape[0], down.shape[1])
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = gate_up[e] @ x[t].float()
            out[t] += w * (down[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def _routing(T, E, top_k):
    # experts E-2 and E-1 never chosen: experts with zero tokens
    logits = torch.randn(T, E)
    logits[:, -2:] = -1e4
    return grouped_topk(logits, top_k=top_k, renormalize=True)


D, INTER, E_TEST = 40, 24, 8  # D, I not multiples of BLOCK_K / BLOCK_N


@pytest.mark.parametrize("kind", ["dense", "int4", "int4_sym", "int4_act_order", "int8", "fp8_tensor", "fp8_channel",
                                  "fp8_block", "fp8_block64"])
def test_reference_matches_per_token_dense(kind):
    gate_up, gate_up_dense = _stacked(kind, E_TEST, 2 * INTER, D)
    down, down_dense = _stacked(kind, E_TEST, D, INTER)
    x = torch.randn(5, D)
    weights, ids = _routing(5, E_TEST, 2)
    expected = _per_token_moe(x, gate_up_dense, down_dense, weights, ids)
    torch.testing.assert_close(fused_moe_reference(x, gate_up, down, weights, ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,T,top_k,dtype", [
    ("dense", 1, 1, torch.float32),
    ("dense", 3, 2, torch.float16),
    ("dense", 33, 6, torch.float32),
    ("dense", 17, 2, torch.bfloat16),
    ("int4", 3, 6, torch.float32),
    ("int4", 5, 2, torch.bfloat16),
    ("int4", 3, 2, torch.float16),  # fp16 (the interpreter's word path, common.int4_words_minus_zero), asymmetric
    ("int4_sym", 33, 2, torch.float16),
    ("int4_act_order", 3, 2, torch.float32),
    ("int4_act_order", 17, 2, torch.float16),
    ("int8", 3, 2, torch.float32),
    ("fp8_tensor", 3, 2, torch.float32),
    ("fp8_channel", 3, 6, torch.float32),
    ("fp8_block", 33, 6, torch.float16),
    ("fp8_block64", 17, 2, torch.float32),
])
def test_fused_moe_matches_loop_reference(kind, T, top_k, dtype):
    """fp8 experts weight-only here (as below sm_89 and for weight-only checkpoints); W8A8: the tests below."""
    gate_up, _ = _stacked(kind, E_TEST, 2 * INTER, D)
    down, _ = _stacked(kind, E_TEST, D, INTER)
    if kind == "dense":
        gate_up, down = DenseWeight(gate_up.weight.to(dtype)), DenseWeight(down.weight.to(dtype))
    x = torch.randn(T, D).to(dtype)
    weights, ids = _routing(T, E_TEST, top_k)
    out = fused_moe(x, gate_up, down, weights, ids, weight_only=True if kind.startswith("fp8") else None)
    assert out.dtype == dtype and out.shape == (T, D)
    ref = fused_moe_reference(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("kind", ["int4", "fp8_block"])
def test_one_layer_reuses_its_launches_across_calls(kind):
    """A layer's MoEExperts resolves each T bucket's launches once and binds each call's tokens, routing and
    alignment: calls of T 3, 4 (one bucket), 1, 3 again and 17 in turn each equal the per-token loop (fp8 block
    experts: W8A8, the activation scales bound per call too), one plan per bucket."""
    gate_up, gate_up_dense = _stacked(kind, E_TEST, 2 * INTER, D)
    down, down_dense = _stacked(kind, E_TEST, D, INTER)
    layer = moe.MoEExperts(gate_up, down)
    for T in (3, 4, 1, 3, 17):
        x = torch.randn(T, D) * 3
        weights, ids = _routing(T, E_TEST, 2)
        out = layer(x, weights, ids)
        if kind == "fp8_block":
            expected = _w8a8_reference(x, gate_up_dense, down_dense, weights, ids, 32)
        else:
            expected = _per_token_moe(x, gate_up_dense, down_dense, weights, ids)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert sorted(tokens for tokens, *_ in layer.plans) == [1, 4, 32]


def test_layer_routes_once_and_takes_the_alignment():
    """MoEExperts.route (routing and the alignment for the layer's plan, one launch) passed to the layer's call:
    the per-token loop over the reference routing, at T 1, 3 and 17. An alignment for another block_m, or with a
    config of the caller's (another plan), is refused."""
    gate_up, gate_up_dense = _stacked("int4", E_TEST, 2 * INTER, D)
    down, down_dense = _stacked("int4", E_TEST, D, INTER)
    layer = moe.MoEExperts(gate_up, down)
    for T in (1, 3, 17):
        x, logits = torch.randn(T, D) * 3, torch.randn(T, E_TEST)
        weights, ids, alignment = layer.route(x, logits, 2, renormalize=True)
        ref_weights, ref_ids = grouped_topk_reference(logits, 2, renormalize=True)
        assert torch.equal(ids, ref_ids)
        expected = _per_token_moe(x, gate_up_dense, down_dense, ref_weights, ref_ids)
        torch.testing.assert_close(layer(x, weights, ids, alignment=alignment), expected, rtol=1e-4, atol=1e-4)
    block_m = layer.plans[(32, 2, x.dtype, False)].block_m
    with pytest.raises(ValueError, match="alignment must be int32 tensors of shapes"):
        layer(x, weights, ids, alignment=moe_align_block_size(ids, 2 * block_m, E_TEST))
    with pytest.raises(ValueError, match="precomputed alignment is for the Triton backend's default plan"):
        layer(x, weights, ids, config=moe.DEFAULT_CONFIGS[0][1], alignment=alignment)


@pytest.mark.parametrize("backend", ["triton", "cpu", "torch"])
@pytest.mark.parametrize("kind,T,top_k", [("dense", 33, 6), ("int4", 5, 2), ("dense", 3, 1)])
def test_dropped_slots_contribute_nothing(monkeypatch, backend, kind, T, top_k):
    """Expert parallelism marks slots of another rank's experts -1: the result is the per-token loop with those
    slots' weights zero (every path: Triton kernels, CPU backend, torch reference). A whole dropped row included."""
    monkeypatch.setenv("TRITONQ_BACKEND", {"cpu": "auto"}.get(backend, backend))
    if backend == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gate_up, gate_up_dense = _stacked(kind, E_TEST, 2 * INTER, D)
    down, down_dense = _stacked(kind, E_TEST, D, INTER)
    x = torch.randn(T, D)
    weights, ids = _routing(T, E_TEST, top_k)
    dropped = ids >= E_TEST // 2  # this "rank" holds experts 0..3
    dropped[0] = True
    expected = _per_token_moe(x, gate_up_dense, down_dense, weights.masked_fill(dropped, 0.0), ids)
    out = fused_moe(x, gate_up, down, weights, ids.masked_fill(dropped, -1))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(out[0], torch.zeros(D))


def test_fp8_native_and_bit_decoding_agree(monkeypatch):
    """The interpreter loads float8 natively (as sm_89+); force the bit decoding of older GPUs to check it too."""
    gate_up, _ = _stacked("fp8_tensor", E_TEST, 2 * INTER, D)
    down, _ = _stacked("fp8_tensor", E_TEST, D, INTER)
    x = torch.randn(3, D)
    weights, ids = _routing(3, E_TEST, 2)
    native = fused_moe(x, gate_up, down, weights, ids, weight_only=True)
    monkeypatch.setattr(moe.launch, "has_fp8_tensor_cores", lambda device: False)
    bits = fused_moe(x, gate_up, down, weights, ids, weight_only=True)
    torch.testing.assert_close(bits, native, rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_e4m3_bit_decoding_covers_all_patterns():
    """Every one of the 256 byte patterns (except the two NaNs) decodes as torch decodes it."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    out = torch.empty(codes.numel())

    @triton.jit
    def decode(b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, common.e4m3_bits_to_fp16(tl.load(b_ptr + offs, mask=offs < n)).to(tl.float32) * common.E4M3_TO_FP16_BIAS, mask=offs < n)

    decode[(1,)](codes, out, codes.numel(), BLOCK=256)
    assert torch.equal(out, codes.view(torch.float8_e4m3fn).float())


def test_fused_moe_rejects_bad_inputs():
    gate_up, down = DenseWeight(torch.randn(E_TEST, 2 * INTER, D)), DenseWeight(torch.randn(E_TEST, D, INTER))
    weights, ids = _routing(2, E_TEST, 2)
    x = torch.randn(2, D)
    with pytest.raises(ValueError, match="stacked"):
        fused_moe(x, DenseWeight(gate_up.weight[0]), down, weights, ids)
    with pytest.raises(ValueError, match="gate_up"):
        fused_moe(x, down, down, weights, ids)
    with pytest.raises(ValueError, match="bias"):
        fused_moe(x, DenseWeight(gate_up.weight, torch.zeros(2 * INTER)), down, weights, ids)
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        fused_moe(x.double(), gate_up, down, weights, ids)
    with pytest.raises(ValueError, match=r"\[T=2, k\]"):
        fused_moe(x, gate_up, down, weights[:, :1], ids)


# ------------------------------------------------------------------ fp8 W8A8 experts

def _w8a8_reference(x, gate_up_dense, down_dense, weights, ids, group):
    """Independent W8A8 reference: each GEMM input rounded to e4m3 per token (group None) or per 1 x group
    columns (scale = absmax / 448, torch's own float8 cast), the hidden first rounded to x.dtype (where the
    kernel stores it); then the per-token loop over dense fp32 weights."""
    def round_trip(a):
        a = a.float()
        g = a.shape[1] if group is None else group
        out = torch.empty_like(a)
        for start in range(0, a.shape[1], g):
            part = a[:, start:start + g]
            scale = part.abs().amax(1, keepdim=True).clamp(min=1e-10) / torch.tensor(448.0)
            out[:, start:start + g] = (part / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return out
    inter = down_dense.shape[2]
    xq = round_trip(x)
    out = torch.zeros(x.shape[0], down_dense.shape[1])
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = gate_up_dense[e] @ xq[t]
            hidden = round_trip((F.silu(h[:inter]) * h[inter:]).to(x.dtype)[None])[0]
            out[t] += w * (down_dense[e] @ hidden)
    return out


@pytest.mark.parametrize("kind,group", [("fp8_tensor", None), ("fp8_channel", None), ("fp8_block", 32),
                                        ("fp8_block64", 64)])
@pytest.mark.parametrize("T", [1, 3, 17, 64])
def test_fused_moe_w8a8_matches_per_token_reference(kind, group, T):
    """fp8 experts from an activation-quantizing checkpoint run W8A8 where the kernel has e4m3 tensor cores
    (the interpreter, as sm_89+): activations per token (per-tensor / per-channel weights) or per 1 x bk group
    (block weights), e4m3 x e4m3 dots in fp32. D = 40, I = 24: N and K off the tiles. Products of e4m3 values are
    exact in fp32, so kernel and reference differ by summation order, unless that moves a hidden value across
    an e4m3 rounding boundary (one code: 2^-3 relative), which these seeded cases do not."""
    gate_up, gate_up_dense = _stacked(kind, E_TEST, 2 * INTER, D)
    down, down_dense = _stacked(kind, E_TEST, D, INTER)
    x = torch.randn(T, D) * 3
    weights, ids = _routing(T, E_TEST, 2)
    assert moe.fp8_w8a8(gate_up, x) and moe.fp8_w8a8(down, x)
    out = fused_moe(x, gate_up, down, weights, ids)
    expected = _w8a8_reference(x, gate_up_dense, down_dense, weights, ids, group)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, fused_moe_reference(x, gate_up, down, weights, ids, w8a8=(True, True)),
                               rtol=1e-4, atol=1e-4)
    # and the activations were rounded: the weight-only result is measurably different
    assert (out - fused_moe_reference(x, gate_up, down, weights, ids)).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_w8a8_half_activations(dtype):
    """fp16 / bf16 models: the same quantization of x (exact in either) and of the hidden, stored in dtype."""
    gate_up, gate_up_dense = _stacked("fp8_block64", E_TEST, 2 * INTER, D)
    down, down_dense = _stacked("fp8_block64", E_TEST, D, INTER)
    x = torch.randn(17, D).to(dtype)
    weights, ids = _routing(17, E_TEST, 2)
    out = fused_moe(x, gate_up, down, weights, ids)
    assert out.dtype == dtype
    expected = _w8a8_reference(x, gate_up_dense, down_dense, weights, ids, 64)
    torch.testing.assert_close(out.float(), expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_fused_moe_w8a8_static_input_scale_is_the_largest_over_experts():
    """A static checkpoint (input_scale per expert): the input is quantized once, before sorting by expert,
    with the largest of the experts' scales (every expert's input in range)."""
    gate_up, gate_up_dense = _stacked("fp8_channel", E_TEST, 2 * INTER, D)
    down, down_dense = _stacked("fp8_channel", E_TEST, D, INTER)
    gate_up = FP8Weight(gate_up.weight, gate_up.weight_scale, input_scale=torch.rand(E_TEST) * 0.01 + 0.01)
    down = FP8Weight(down.weight, down.weight_scale, input_scale=torch.rand(E_TEST) * 0.05 + 0.05)
    x = torch.randn(5, D)
    weights, ids = _routing(5, E_TEST, 2)
    out = fused_moe(x, gate_up, down, weights, ids)
    assert moe.fp8_activation_scheme(gate_up) == (None, gate_up.input_scale.max())

    def static(a, scale):
        return (a.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    expected = torch.zeros(5, D)
    inter = INTER
    for t in range(5):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = gate_up_dense[e] @ static(x[t], gate_up.input_scale.max())
            expected[t] += w * (down_dense[e] @ static(F.silu(h[:inter]) * h[inter:], down.input_scale.max()))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def _a_fp8_spy(monkeypatch):
    """The A_FP8 flag (W8A8) of each _moe_gemm_kernel launch."""
    flags = []
    kernel = moe._moe_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                flags.append(kwargs["A_FP8"])
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(moe.launch, "_moe_gemm_kernel", Spy())
    return flags


def test_w8a8_or_weight_only_follows_checkpoint_and_capability(monkeypatch):
    """The selection rule (`fp8_w8a8`), per GEMM: W8A8 for fp8 experts whose checkpoint quantizes activations on
    e4m3 tensor cores; weight-only for a weight-only checkpoint (FP8Weight.weight_only, kept through the
    loader's fuse and stack), below sm_89, for K blocks below tl.dot's e4m3 minimum, for other expert types, and
    on the CPU backend and the CPU torch reference."""
    from tritonq.quant.weights import concat_outputs, stack_experts

    gate_up, _ = _stacked("fp8_channel", E_TEST, 2 * INTER, D)
    down, _ = _stacked("fp8_channel", E_TEST, D, INTER)
    x = torch.randn(3, D)
    weights, ids = _routing(3, E_TEST, 2)
    flags = _a_fp8_spy(monkeypatch)
    fused_moe(x, gate_up, down, weights, ids)
    assert flags == [True, True]

    # a weight-only checkpoint (compressed-tensors input_activations: null): the flag survives fuse and stack
    def per_expert(w):
        return [FP8Weight(w.weight[e], w.weight_scale[e], weight_only=True) for e in range(E_TEST)]
    gu_parts = [concat_outputs([g, u]) for g, u in zip(
        per_expert(FP8Weight(gate_up.weight[:, :INTER], gate_up.weight_scale[:, :INTER])),
        per_expert(FP8Weight(gate_up.weight[:, INTER:], gate_up.weight_scale[:, INTER:])))]
    wo_gate_up, wo_down = stack_experts(gu_parts), stack_experts(per_expert(down))
    assert wo_gate_up.weight_only and wo_down.weight_only
    flags.clear()
    out = fused_moe(x, wo_gate_up, down, weights, ids)  # the rule is per GEMM: gate/up weight-only, down W8A8
    assert flags == [False, True]
    flags.clear()
    fused_moe(x, gate_up, down, weights, ids, weight_only=True)
    assert flags == [False, False]

    assert not moe.fp8_w8a8(_stacked("int4", E_TEST, D, INTER)[0], x)
    assert not moe.fp8_w8a8(_stacked("dense", E_TEST, D, INTER)[0], x)
    small_block = FP8Weight(down.weight, torch.ones(E_TEST, 3, 2), block_size=(16, 16))  # K block 16 < 32
    assert not moe.fp8_w8a8(small_block, x)
    assert moe.fp8_w8a8(down, torch.empty(3, D, device="meta"))  # AOT: compiled for a GPU with fp8 tensor cores
    with monkeypatch.context() as mp:  # below sm_89
        mp.setattr(moe.launch, "has_fp8_tensor_cores", lambda device: False)
        assert not moe.fp8_w8a8(down, x)
        flags.clear()
        fused_moe(x, gate_up, down, weights, ids)
        assert flags == [False, False]
    x_cpu = torch.randn(3, D, device="cpu")
    with monkeypatch.context() as mp:  # the CPU backend (no interpreter): weight-only, as before
        mp.delenv("TRITON_INTERPRET", raising=False)
        mp.setenv("TRITONQ_BACKEND", "auto")
        assert not moe.fp8_w8a8(down.to("cpu"), x_cpu)
        mp.setenv("TRITONQ_BACKEND", "torch")
        assert not moe.fp8_w8a8(down.to("cpu"), x_cpu)
    # the fused, stacked weight-only experts are the same codes, run weight-only in gate/up only
    assert torch.equal(wo_gate_up.weight, gate_up.weight)
    torch.testing.assert_close(out, fused_moe_reference(x, gate_up, down, weights, ids, w8a8=(False, True)),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inter,one_scale", [(64, [True, True]), (96, [False, True])])
def test_fused_moe_w8a8_scale_block_spanning_the_tile(monkeypatch, inter, one_scale):
    """Scale blocks as wide as the N tile or wider (as 128 x 128 checkpoints under BLOCK_N 64): the kernel loads one
    weight scale per K tile (ONE_W_SCALE) where every tile, gate/up's up half included, lies in one block; an I
    that is no multiple of the block (96 rows: up's tiles straddle blocks) keeps the per-column scales."""
    E, dim, bn, bk = 4, 72, 64, 32

    def stacked(N, K):
        w8 = (torch.randn(E, N, K) * 2).to(torch.float8_e4m3fn)
        s = torch.rand(E, -(-N // bn), -(-K // bk)) * 0.1 + 0.05
        full = s.repeat_interleave(bn, 1)[:, :N].repeat_interleave(bk, 2)[:, :, :K]
        return FP8Weight(w8, s, block_size=(bn, bk)), w8.float() * full
    gate_up, gate_up_dense = stacked(2 * inter, dim)
    down, down_dense = stacked(dim, inter)
    x = torch.randn(17, dim)
    weights, ids = grouped_topk(torch.randn(17, E), 2, renormalize=True)
    seen = []
    kernel = moe._moe_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["ONE_W_SCALE"])
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(moe.launch, "_moe_gemm_kernel", Spy())
    out = fused_moe(x, gate_up, down, weights, ids, config=moe.MoEConfig(16, 64, 32, 4, 2))
    assert seen == one_scale
    torch.testing.assert_close(out, _w8a8_reference(x, gate_up_dense, down_dense, weights, ids, bk),
                               rtol=1e-4, atol=1e-4)


def test_w8a8_block_k_must_fit_the_scale_block():
    """Explicit configs for W8A8 block weights: BLOCK_K must divide the K block and be >= 32; the defaults are
    narrowed to the K block instead (fp8_block: 32-wide K blocks under a default BLOCK_K of 64)."""
    from tritonq.kernels.moe import MoEConfig
    gate_up, _ = _stacked("fp8_block", E_TEST, 2 * INTER, D)
    down, _ = _stacked("fp8_block", E_TEST, D, INTER)
    x = torch.randn(3, D)
    weights, ids = _routing(3, E_TEST, 2)
    for block_k in (64, 16):
        with pytest.raises(ValueError, match=f"BLOCK_K={block_k} with W8A8 fp8 experts"):
            fused_moe(x, gate_up, down, weights, ids, config=MoEConfig(16, 32, block_k, 4, 2))
    fused_moe(x, gate_up, down, weights, ids, config=MoEConfig(16, 32, 32, 4, 2))
    with pytest.raises(ValueError, match="W8A8 .* needs FP8 experts, float8_e4m3fn activations and fp8 tensor cores"):
        moe.aot_launch(MoEConfig(16, 64, 64, 4, 3), (16, 8, 2, 256, 128, 0), "fp8", native_fp8=False, w8a8=True)


# ------------------------------------------------------------------ explicit configs

def _moe_launch_spy(monkeypatch):
    launches = []
    kernel = moe._moe_gemm_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append({key: kwargs[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps",
                                                             "num_stages")})
                return kernel[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(moe.launch, "_moe_gemm_kernel", Spy())
    return launches


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_fused_moe_explicit_config_pair_is_launched_and_matches_reference(monkeypatch, kind):
    from tritonq.kernels.moe import MoEConfig
    gate_up, _ = _stacked(kind, E_TEST, 2 * INTER, D)
    down, _ = _stacked(kind, E_TEST, D, INTER)
    x = torch.randn(33, D)
    weights, ids = _routing(33, E_TEST, 3)
    first, second = MoEConfig(16, 32, 32, 8, 2), MoEConfig(16, 16, 16, 2, 4)
    launches = _moe_launch_spy(monkeypatch)
    out = fused_moe(x, gate_up, down, weights, ids, config=(first, second))
    assert launches == [vars(first), vars(second)]  # gate/up first, then down
    torch.testing.assert_close(out, fused_moe_reference(x, gate_up, down, weights, ids),
                               rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_fused_moe_one_config_covers_both_gemms(monkeypatch):
    from tritonq.kernels.moe import MoEConfig
    gate_up, _ = _stacked("dense", E_TEST, 2 * INTER, D)
    down, _ = _stacked("dense", E_TEST, D, INTER)
    x = torch.randn(5, D)
    weights, ids = _routing(5, E_TEST, 2)
    cfg = MoEConfig(32, 64, 16, 4, 3)
    launches = _moe_launch_spy(monkeypatch)
    out = fused_moe(x, gate_up, down, weights, ids, config=cfg)
    assert launches == [vars(cfg)] * 2
    torch.testing.assert_close(out, fused_moe_reference(x, gate_up, down, weights, ids),
                               rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_bad_moe_configs_raise_clear_errors():
    from tritonq.kernels.moe import MoEConfig
    gate_up, down = DenseWeight(torch.randn(E_TEST, 2 * INTER, D)), DenseWeight(torch.randn(E_TEST, D, INTER))
    weights, ids = _routing(2, E_TEST, 2)
    x = torch.randn(2, D)
    good = MoEConfig(16, 64, 64, 4, 3)
    for config, message in [(MoEConfig(16, 64, 48, 4, 3), "BLOCK_K = 48, expected a power of two >= 16"),
                            (MoEConfig(8, 64, 64, 4, 3), "BLOCK_M = 8"),
                            (MoEConfig(16, 64, 64, 6, 3), "num_warps = 6"),
                            (MoEConfig(16, 64, 64, 4, 0), "num_stages = 0"),
                            ((good, MoEConfig(32, 64, 64, 4, 3)), "BLOCK_M must match"),
                            ({"BLOCK_M": 16}, "must be a MoEConfig"),
                            ((good,), "must be a MoEConfig")]:
        with pytest.raises(ValueError, match=message):
            fused_moe(x, gate_up, down, weights, ids, config=config)


# ------------------------------------------------------------------ the decode tile of the word paths

# K and N of both GEMMs around the word paths' decode tile (moe.WORD_DECODE_CONFIG, 16 x 64 x 128): gate/up K = 384
# (three whole K tiles, no mask) and N = 160 (ragged); down K = 160 (one whole tile and a masked 32-row tail),
# N = 384 (no mask).
WD, WINTER = 384, 160


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("kind", ["int4", "int4_sym"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int4_decode_tile_matches_per_token_reference(T, top_k, kind, dtype):
    """Int4 experts at the decode tile: gate/up with groups of 128 (one scale row per K tile: the scale on the dot's
    result, SCALE_AFTER_DOT, where the word path runs), down with groups of 32 (scales per weight) and the ragged K
    tail, against the per-token loop over the dense weights."""
    gate_up, gate_up_dense = _stacked(kind, E_TEST, 2 * WINTER, WD, group_size=128)
    down, down_dense = _stacked(kind, E_TEST, WD, WINTER, group_size=32)
    gate_up, down = (Int4Weight(w.qweight, w.scales.to(dtype), None if w.zeros is None else w.zeros.to(dtype),
                                None, w.group_size, w.bits) for w in (gate_up, down))
    x = torch.randn(T, WD).to(dtype)
    weights, ids = _routing(T, E_TEST, top_k)
    layer = moe.MoEExperts(gate_up, down)
    out = layer(x, weights, ids)
    (launch, _, _), _ = layer.plans[(common.next_pow2(T), top_k, dtype, False)].gemms
    words = launch.args["WORD_DEQUANT"]  # fp16 under the interpreter, both dtypes on a GPU
    if T * top_k / E_TEST < 16:  # the decode tile of each path
        assert launch.args["BLOCK_K"] == (128 if words else 64)
    assert launch.args["SCALE_AFTER_DOT"] == words
    expected = _per_token_moe(x.float(), gate_up_dense.to(dtype).float(), down_dense.to(dtype).float(), weights, ids)
    # outputs reach ~35 here: the dtype's rounding of x, weights and hidden, relative to the largest output
    torch.testing.assert_close(out.float(), expected, rtol=TOL[dtype], atol=TOL[dtype] * expected.abs().max())


def _mxfp4(E, N, K, std):
    g = torch.Generator().manual_seed(N * K)
    q = quantize_mxfp4(torch.randn(E, N, K, generator=g, device="cpu") * std)
    return MXFP4Weight(q.blocks.to(torch.get_default_device()), q.scales.to(torch.get_default_device()))


@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", ["small", "large"])
def test_mxfp4_decode_tile_matches_reference(T, top_k, dtype, scale):
    """MXFP4 experts at the decode tile, both dtypes on the word path (common.mxfp4_words_to_half), against the
    torch reference on the exactly dequantized weights. large: weights up to ~2^5 (E8M0 exponents past
    MXFP4_ONE_FACTOR_MAX_SCALE: the plan picks the two-factor PTX)."""
    std = 0.5 if scale == "small" else 16.0
    gate_up, down = _mxfp4(E_TEST, 2 * WINTER, WD, std), _mxfp4(E_TEST, WD, WINTER, std * 0.5)
    big = max(int(w.scales.max()) for w in (gate_up, down)) > common.MXFP4_ONE_FACTOR_MAX_SCALE
    assert big == (scale == "large")
    x = torch.randn(T, WD).to(dtype) / (1.0 if scale == "small" else 64.0)
    weights, ids = _routing(T, E_TEST, top_k)
    layer = moe.MoEExperts(gate_up, down)
    out = layer(x, weights, ids)
    (launch, _, _), _ = layer.plans[(common.next_pow2(T), top_k, dtype, False)].gemms
    assert launch.args["WORD_DEQUANT"] and launch.args["MXFP4_STEPS"] == (2 if big else 1)
    expected = fused_moe_reference(x.float(), gate_up, down, weights, ids)
    torch.testing.assert_close(out.float(), expected, rtol=TOL[dtype], atol=TOL[dtype] * expected.abs().max())


def test_mxfp4_fp16_refuses_scales_past_its_range(device):
    """A scale of 2^17 (E8M0 exponent 144) makes every nonzero weight of its group overflow fp16: fp16 refuses it
    with what to do, before any launch; bf16 takes it."""
    if device.type == "meta":
        pytest.skip("the refusal reads the scales' values, which meta tensors do not hold")
    gate_up, down = _mxfp4(E_TEST, 64, 64, 0.5), _mxfp4(E_TEST, 64, 32, 0.5)  # D = 64, I = 32
    scales = gate_up.scales.clone()
    scales[0, 0, 0] = common.MXFP4_FP16_MAX_SCALE + 1
    gate_up = MXFP4Weight(gate_up.blocks.to(device), scales.to(device))
    down = MXFP4Weight(down.blocks.to(device), down.scales.to(device))
    x = torch.randn(2, 64).to(device)
    weights, ids = (t.to(device) for t in _routing(2, E_TEST, 2))
    with pytest.raises(ValueError, match=r"scale of 2\^17 \(E8M0 exponent 144\) in fp16.*run the model in bfloat16"):
        fused_moe(x.half(), gate_up, down, weights, ids)
    assert fused_moe(x.bfloat16(), gate_up, down, weights, ids).shape == (2, 64)


# ------------------------------------------------------------------ the down GEMM's sum over the k slots

E_SUM = 12  # room for top-k 8 besides the two experts _routing never picks


def _sum_case(kind, T, top_k):
    """(layer, x, weights, ids, reference(x, weights, ids) -> [T, D] fp32, dtype tolerance) for one kind of experts:
    dense fp32, int4 fp16 (asymmetric, groups of 16), MXFP4 bf16, fp8 block-scaled W8A8 fp32; the reference is the
    per-token loop over the dense fp32 weights (W8A8: with the kernel's activation rounding, `_w8a8_reference`)."""
    if kind == "mxfp4":
        gate_up, down = _mxfp4(E_SUM, 64, 96, 0.5), _mxfp4(E_SUM, 96, 32, 0.5)  # K: multiples of 32; I = 32
        dense = [torch.stack([w.expert(e).dequantize(torch.float32) for e in range(E_SUM)]) for w in (gate_up, down)]
        d, dtype = 96, torch.bfloat16
    else:
        (gate_up, gu_dense), (down, dn_dense) = (_stacked(kind, E_SUM, 2 * INTER, D),
                                                 _stacked(kind, E_SUM, D, INTER))
        dense, d = [gu_dense, dn_dense], D
        dtype = torch.float16 if kind == "int4" else torch.float32
    if kind == "int4":
        gate_up, down = (Int4Weight(w.qweight, w.scales, w.zeros, None, w.group_size, w.bits) for w in (gate_up, down))
    x = (torch.randn(T, d) * (3 if kind == "fp8_block" else 1)).to(dtype)
    weights, ids = _routing(T, E_SUM, top_k)

    def reference(x, weights, ids):
        if kind == "fp8_block":
            return _w8a8_reference(x, *dense, weights, ids, 32)
        return _per_token_moe(x.float(), *(w.to(dtype).float() for w in dense), weights, ids)
    return moe.MoEExperts(gate_up, down), x, weights, ids, reference, TOL[dtype]


@pytest.mark.parametrize("kind", ["dense", "int4", "mxfp4", "fp8_block"])
@pytest.mark.parametrize("T,top_k", [(1, 8), (3, 6), (17, 2), (64, 1), (3, 1), (17, 8)])
@pytest.mark.parametrize("held", ["all", "half"])
def test_down_gemm_sums_the_slots(kind, T, top_k, held):
    """The down GEMM writes [T, D] itself, each token's k weighted slot rows added in slot order by the last row
    block of each column tile (`common.sum_expert_slots`), against the per-token loop: top-k 1 to 8, tokens 1 to 64,
    D = 40 (MXFP4: 96) off the column tiles. held "half": expert parallelism, a rank holding experts 0..5 (the
    others' slots -1, weight 0 in the reference) and token 0 none of its experts (a zero row; at T = 1 no row block
    runs at all and the first one still writes it). Run again on the same inputs: bit for bit the same."""
    layer, x, weights, ids, reference, tol = _sum_case(kind, T, top_k)
    if held == "half":
        dropped = ids >= E_SUM // 2
        dropped[0] = True
        weights, ids = weights.masked_fill(dropped, 0.0), ids.masked_fill(dropped, -1)
    out = layer(x, weights, ids)
    (_, _, _), (down, _, _) = layer.plans[(common.next_pow2(T), top_k, x.dtype, False)].gemms
    assert down.args["SUM_SLOTS"] and out.shape == (T, x.shape[1]) and out.dtype == x.dtype
    expected = reference(x, weights, ids)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * max(1.0, expected.abs().max().item()))
    if held == "half":
        assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(layer(x, weights, ids), out)
    assert not down.args["arrivals_ptr"].any()  # the counts back at zero for the next launch


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_slot_sum_of_a_token_does_not_depend_on_the_batch(kind):
    """Batch-invariant mode (one config for every T): each token's output alone equals its row among 17 tokens bit
    for bit, its slots summed in slot order whatever blocks they landed in."""
    from tritonq.kernels import batch_invariant_mode
    layer, x, weights, ids, _, _ = _sum_case(kind, 17, 6)
    with batch_invariant_mode():
        batch = layer(x, weights, ids)
        for t in (0, 5, 16):
            assert torch.equal(layer(x[t:t + 1], weights[t:t + 1], ids[t:t + 1])[0], batch[t])
