"""Attention sinks (gpt-oss) in the paged prefill and decode kernels (Triton interpreter), the CPU
backend and the torch references, against transformers' own gpt-oss eager attention.

The independent reference is `transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward`
run on each sequence's keys alone with an additive causal / sliding-window mask: it appends the sink
logit to the scores, softmaxes and drops it. Lengths are odd (1, 7, 33 new tokens after cached
prefixes of 0, 17 and 300; cache lengths 1, 65 and 300), GQA 4 and 1, windows below a key block,
across pages and longer than every sequence; decode runs several KV splits (empty ones included),
so the sink's single entry in the split merge is checked. Sinks are N(0, 2^2) plus one of +6 (a sink
that takes most of the mass) and -30 (none of it).
"""
from types import SimpleNamespace

import pytest
import torch
import tolerances
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from tritonq.kernels.attention import (decode_attention, decode_attention_reference, decode_launches,
                                       paged_cache, paged_prefill_attention, paged_prefill_attention_reference,
                                       DecodeConfig)

TOL = tolerances.table("attention")
PREFIXES, NEW_TOKENS = [0, 17, 300], [7, 33, 1]
CACHE_LENS = [1, 65, 300]
# (H, Hkv, D)
HEADS = [(8, 2, 64), (4, 1, 96)]
WINDOWS = [0, 5, 40, 1000]


def randn(*shape, generator):
    return torch.randn(*shape, generator=generator, device="cpu").to(torch.get_default_device())


def make_sinks(h, generator):
    sinks = randn(h, generator=generator) * 2
    sinks[0], sinks[-1] = 6.0, -30.0
    return sinks.float()


def transformers_attention(q, k, v, scale, positions, window, sinks):
    """q [n_q, H, D] at `positions`, k/v [n_k, Hkv, D] (keys 0 .. n_k - 1) -> [n_q, H, D] float32 through
    transformers' gpt-oss eager attention with an additive causal (and window) mask."""
    h, h_kv = q.shape[1], k.shape[1]
    key = torch.arange(k.shape[0])[None, :]
    visible = (key <= positions[:, None]) & ((positions[:, None] - key < window) if window else True)
    mask = torch.zeros(visible.shape).masked_fill(~visible.cpu(), float("-inf")).to(q.device)
    module = SimpleNamespace(num_key_value_groups=h // h_kv, sinks=sinks.float(), training=False)
    out, _ = eager_attention_forward(module, q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None],
                                     v.float().transpose(0, 1)[None], mask[None, None], scale)
    return out[0]  # [n_q, H, D]: transformers returns [B, n_q, H, D]


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def paged_context(ctx_lens, h_kv, d, dtype, generator, page_size=16):
    S = max(ctx_lens)
    k = randn(len(ctx_lens), S, h_kv, d, generator=generator).to(dtype)
    v = randn(len(ctx_lens), S, h_kv, d, generator=generator).to(dtype)
    num_pages = len(ctx_lens) * -(-S // page_size) + 3
    k_pages, v_pages, table = paged_cache(k, v, page_size, num_pages, generator)
    return k, v, k_pages, v_pages, table


def lens(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("h,h_kv,d", HEADS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_with_sinks_matches_transformers_eager_attention(h, h_kv, d, window, dtype):
    g = torch.Generator().manual_seed(11)
    ctx = [p + n for p, n in zip(PREFIXES, NEW_TOKENS)]
    k, v, k_pages, v_pages, table = paged_context(ctx, h_kv, d, dtype, g)
    q = randn(sum(NEW_TOKENS), h, d, generator=g).to(dtype)
    cu = torch.tensor([0, 7, 40, 41], dtype=torch.int32)
    sinks = make_sinks(h, g)
    scale = 0.9 / d ** 0.5
    out = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx), table, scale, window, sinks=sinks)
    ref = paged_prefill_attention_reference(q, k_pages, v_pages, cu, lens(ctx), table, scale, window, sinks)
    assert out.dtype == dtype and out.shape == (sum(NEW_TOKENS), h, d)
    for b, (prefix, n) in enumerate(zip(PREFIXES, NEW_TOKENS)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = transformers_attention(q[rows], k[b, :ctx[b]], v[b, :ctx[b]], scale,
                                          torch.arange(prefix, prefix + n), window, sinks)
        assert_close(out[rows], expected, dtype)
        assert_close(ref[rows], expected, dtype)
    # The sinks change the output (a dropped sink would pass the comparisons above only by accident).
    plain = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx), table, scale, window)
    assert (plain.float() - out.float()).abs().max() > 0.1


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("h,h_kv,d", HEADS)
def test_decode_with_sinks_matches_transformers_eager_attention_across_splits(h, h_kv, d, window):
    g = torch.Generator().manual_seed(12)
    dtype = torch.float16
    k, v, k_pages, v_pages, table = paged_context(CACHE_LENS + [0], h_kv, d, dtype, g)
    q = randn(len(CACHE_LENS) + 1, h, d, generator=g).to(dtype)
    sinks = make_sinks(h, g)
    out = decode_attention(q, k_pages, v_pages, lens(CACHE_LENS + [0]), table, 0.1, window, sinks=sinks)
    ref = decode_attention_reference(q, k_pages, v_pages, lens(CACHE_LENS + [0]), table, 0.1, window, sinks)
    for b, n in enumerate(CACHE_LENS):
        expected = transformers_attention(q[b, None], k[b, :n], v[b, :n], 0.1, torch.tensor([n - 1]), window,
                                          sinks)[0]
        assert_close(out[b], expected, dtype)
        assert_close(ref[b], expected, dtype)
    # A padding row (no keys) gives zeros, sink or not.
    assert out[-1].abs().max() == 0 and ref[-1].abs().max() == 0


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_decode_sink_enters_the_split_merge_once(splits):
    """Whatever the number of KV splits (8: most of them empty for the short rows), the merged output
    is the reference's: the sink is counted once, not once per split."""
    g = torch.Generator().manual_seed(13)
    h, h_kv, d, dtype = 8, 2, 64, torch.float32
    _, _, k_pages, v_pages, table = paged_context(CACHE_LENS, h_kv, d, dtype, g)
    q = randn(len(CACHE_LENS), h, d, generator=g).to(dtype)
    sinks = make_sinks(h, g)
    cfg = DecodeConfig(BLOCK_N=16, NUM_SPLITS=splits, num_warps=1, num_stages=1)
    split, merge, out = decode_launches(q, k_pages, v_pages, lens(CACHE_LENS), table, 0.1, 0, cfg, sinks)
    split()
    if splits > 1:
        merge()
    else:  # one split: the split kernel writes the output itself (the merge folded in)
        assert merge is None
    ref = decode_attention_reference(q, k_pages, v_pages, lens(CACHE_LENS), table, 0.1, 0, sinks)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_with_sinks_matches_references(monkeypatch, window, dtype):
    """The CPU backend (torch's flash kernel, rescaled by its log-sum-exp) against the float32 references,
    which the tests above hold to transformers."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    g = torch.Generator().manual_seed(14)
    h, h_kv, d = 8, 2, 64
    ctx = [p + n for p, n in zip(PREFIXES, NEW_TOKENS)]
    with torch.device("cpu"):
        _, _, k_pages, v_pages, table = paged_context(ctx + [0], h_kv, d, dtype, g)
        q = randn(sum(NEW_TOKENS), h, d, generator=g).to(dtype)
        cu = torch.tensor([0, 7, 40, 41, 41], dtype=torch.int32)
        sinks = make_sinks(h, g)
        out = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx + [0]), table, 0.1, window, sinks=sinks)
        ref = paged_prefill_attention_reference(q, k_pages, v_pages, cu, lens(ctx + [0]), table, 0.1, window, sinks)
        assert out.dtype == dtype
        assert_close(out, ref, dtype)
        q1 = randn(len(ctx) + 1, h, d, generator=g).to(dtype)
        out = decode_attention(q1, k_pages, v_pages, lens(ctx + [0]), table, 0.1, window, sinks=sinks)
        ref = decode_attention_reference(q1, k_pages, v_pages, lens(ctx + [0]), table, 0.1, window, sinks)
        assert_close(out, ref, dtype)
        assert out[-1].abs().max() == 0


def test_bad_sinks_raise_clear_errors():
    g = torch.Generator().manual_seed(15)
    _, _, k_pages, v_pages, table = paged_context([5], 2, 64, torch.float32, g)
    q = randn(1, 8, 64, generator=g)
    for bad in (torch.zeros(7), torch.zeros(8, dtype=torch.float16), torch.zeros(8, 1), [0.0] * 8):
        with pytest.raises(ValueError, match=r"sinks must be a float32 tensor \[8\]"):
            decode_attention(q, k_pages, v_pages, lens([5]), table, 0.1, sinks=bad)
        with pytest.raises(ValueError, match=r"sinks must be a float32 tensor \[8\]"):
            paged_prefill_attention(q, k_pages, v_pages, torch.tensor([0, 1], dtype=torch.int32), lens([5]), table,
                                    0.1, sinks=bad)
