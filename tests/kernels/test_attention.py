"""Attention kernels (run by the Triton interpreter) against torch SDPA and our torch references.

The independent reference is torch.nn.functional.scaled_dot_product_attention in float32, run on
each sequence's valid tokens alone, so padding, per-sequence lengths and GQA are checked against
code we did not write. Shapes are small (few heads) but odd: lengths {1, 7, 33} and cache lengths
{1, 65, 300} cover partial blocks, one-token sequences and empty decode splits.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F
import tolerances

from tritonq.kernels.attention import (
    decode_attention,
    decode_attention_reference,
    paged_cache,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    alibi_slopes,
    paged_prompts,
    write_kv_slots,
    write_kv_slots_reference,
)

# Inputs are N(0, 1) and outputs are averages of v rows (|o| < ~3). fp32 differs only by summation
# order and exp2 vs exp. In fp16/bf16 the probabilities are rounded to the input dtype before the
# PV dot (as every flash kernel does), and the output is rounded once: a few ulps of that dtype.
# bf16 is not run here: triton 3.9's interpreter does bf16 arithmetic on the raw bits (a bf16
# tile times 1.0 comes back as ~1e32, and so does a bf16 tl.dot), so bf16 is covered by the AOT
# fit test (tests/aot/test_fit.py) and by the GPU benchmark, which checks against SDPA in bf16.
TOL = tolerances.table("attention")

# (Dqk, Dv, H, Hkv): head dims 64, 128, 96 and DeepSeek-V2's 192/128; GQA ratios 1, 4, 8.
HEADS = [(64, 64, 2, 2), (128, 128, 4, 1), (192, 128, 2, 2), (96, 96, 8, 1)]
SEQ_LENS = [1, 7, 33]
CACHE_LENS = [1, 65, 300]
S_MAX = 301  # not a multiple of any block size


def sdpa(q, k, v, scale, causal):
    """q [L,H,Dqk], k [L',Hkv,Dqk], v [L',Hkv,Dv] -> [L,H,Dv] in float32 via torch SDPA."""
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                         v.float().transpose(0, 1), is_causal=causal, scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def randn(*shape, generator: torch.Generator) -> torch.Tensor:
    """Seeded N(0, 1) float32 on the test's device, drawn on the CPU: a CPU generator cannot fill a CUDA tensor."""
    return torch.randn(*shape, generator=generator, device="cpu").to(torch.get_default_device())


def randperm(n: int, generator: torch.Generator) -> torch.Tensor:
    """A seeded permutation of 0 .. n - 1 on the test's device, drawn on the CPU (see randn)."""
    return torch.randperm(n, generator=generator, device="cpu").to(torch.get_default_device())


def lens(values):
    return torch.tensor(values, dtype=torch.int32)


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("d_qk,d_v,h,h_kv", HEADS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prompt_prefill_matches_sdpa_per_sequence(d_qk, d_v, h, h_kv, dtype):
    """Whole prompts (no cached prefix) over shuffled pages with garbage between them."""
    g = torch.Generator().manual_seed(0)
    B, S = len(SEQ_LENS), max(SEQ_LENS)
    q = randn(B, S, h, d_qk, generator=g).to(dtype)
    k = randn(B, S, h_kv, d_qk, generator=g).to(dtype)
    v = randn(B, S, h_kv, d_v, generator=g).to(dtype)
    scale = 0.7 / d_qk ** 0.5  # not the default, so a dropped scale would show
    args = paged_prompts(q, k, v, SEQ_LENS, 16, num_pages=12, generator=g)
    out = paged_prefill_attention(*args, scale)
    ref = paged_prefill_attention_reference(*args, scale)
    assert out.shape == (sum(SEQ_LENS), h, d_v) and out.dtype == dtype
    cu = args[3]
    for b, n in enumerate(SEQ_LENS):
        expected = sdpa(q[b, :n], k[b, :n], v[b, :n], scale, causal=True)
        assert_close(out[cu[b]:cu[b + 1]], expected, dtype)
        assert_close(ref[cu[b]:cu[b + 1]], expected, dtype)


# 80 heads on one kv head: two query-head blocks, the second partly masked; 72 = 64 + ragged tail;
# 576 / 512: DeepSeek-V2's absorbed-MLA decode (16 heads on one latent kv head).
@pytest.mark.parametrize("d_qk,d_v,h,h_kv", HEADS + [(72, 40, 80, 1), (576, 512, 16, 1)])
@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_matches_sdpa_over_each_sequence(d_qk, d_v, h, h_kv, page_size):
    """Pages in shuffled order with garbage in unused pages: only the block table locates a sequence."""
    g = torch.Generator().manual_seed(1)
    B, dtype = len(CACHE_LENS), torch.float16
    q = randn(B, h, d_qk, generator=g).to(dtype)
    k = randn(B, S_MAX, h_kv, d_qk, generator=g).to(dtype)
    v = randn(B, S_MAX, h_kv, d_v, generator=g).to(dtype)
    k_pages, v_pages, table = paged_cache(k, v, page_size, 80, g)
    scale = 1.3 / d_qk ** 0.5
    out = decode_attention(q, k_pages, v_pages, lens(CACHE_LENS), table, scale)
    ref = decode_attention_reference(q, k_pages, v_pages, lens(CACHE_LENS), table, scale)
    assert out.shape == (B, h, d_v) and out.dtype == dtype
    for b, n in enumerate(CACHE_LENS):
        expected = sdpa(q[b, None], k[b, :n], v[b, :n], scale, causal=False)[0]
        assert_close(out[b], expected, dtype)
        assert_close(ref[b], expected, dtype)


def test_cpu_runtime_path_handles_bf16_in_float32(monkeypatch):
    """The runtime's CPU path (torch references) takes bf16 inputs and computes in float32."""
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    B, S, h, h_kv, d_qk, d_v = 3, 33, 4, 1, 192, 128
    q, k = torch.randn(B, S, h, d_qk).bfloat16(), torch.randn(B, S, h_kv, d_qk).bfloat16()
    v = torch.randn(B, S, h_kv, d_v).bfloat16()
    packed, k_pages, v_pages, cu, ctx, table = paged_prompts(q, k, v, SEQ_LENS, 16)
    out = paged_prefill_attention(packed, k_pages, v_pages, cu, ctx, table, 0.1)
    step = decode_attention(q[torch.arange(B), ctx.long() - 1], k_pages, v_pages, ctx, table, 0.1)
    assert out.dtype == step.dtype == torch.bfloat16
    for b, n in enumerate(SEQ_LENS):  # only the final rounding to bf16 differs: half a bf16 ulp
        expected = sdpa(q[b, :n], k[b, :n], v[b, :n], 0.1, causal=True)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]].float(), expected, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(step[b].float(), expected[-1], atol=1e-2, rtol=1e-2)


def slots_of(table: torch.Tensor, page_size: int, b: int, positions) -> torch.Tensor:
    """int64 slots of sequence b's `positions` through its block table row: page * page_size + offset."""
    pos = torch.as_tensor(positions, dtype=torch.int64)
    return table[b].long()[pos // page_size] * page_size + pos % page_size


def test_prefill_then_decode_through_cache_equals_longer_prefill():
    """Prefill's k/v written to pages, then the new token's, one decode step reads them: the same as
    prefilling one more token."""
    B, h, h_kv, d_qk, d_v, scale, page_size = 3, 4, 1, 192, 128, 0.1, 16
    n = torch.tensor(SEQ_LENS)
    S = int(n.max()) + 1
    q, k, v = torch.randn(B, S, h, d_qk), torch.randn(B, S, h_kv, d_qk), torch.randn(B, S, h_kv, d_v)
    longer = paged_prompts(q, k, v, (n + 1).tolist(), 16)
    full = paged_prefill_attention(*longer, scale)
    table = torch.randperm(B * 3).view(B, 3).to(torch.int32)  # 3 pages of 16 hold 40 positions
    k_pages, v_pages = torch.zeros(B * 3, page_size, h_kv, d_qk), torch.zeros(B * 3, page_size, h_kv, d_v)
    for b, length in enumerate(n.tolist()):
        write_kv_slots(k_pages, v_pages, k[b, :length], v[b, :length], slots_of(table, page_size, b, range(length)))
    idx = torch.arange(B)
    new_slots = torch.cat([slots_of(table, page_size, b, [length]) for b, length in enumerate(n.tolist())])
    write_kv_slots(k_pages, v_pages, k[idx, n], v[idx, n], new_slots)  # the new token of every sequence at once
    out = decode_attention(q[idx, n], k_pages, v_pages, lens((n + 1).tolist()), table, scale)
    assert_close(out, full[longer[3][1:].long() - 1], torch.float32)  # each sequence's last row


def test_paged_write_lands_in_the_table_pages_and_nowhere_else():
    page_size, B, S, h_kv, d_qk, d_v = 16, 3, 20, 2, 24, 40  # 20 tokens straddle a page boundary
    g = torch.Generator().manual_seed(2)
    table = randperm(12, generator=g)[:9].view(B, 3).to(torch.int32)
    k_pages, v_pages = torch.randn(12, page_size, h_kv, d_qk), torch.randn(12, page_size, h_kv, d_v)
    k, v = torch.randn(B, S, h_kv, d_qk), torch.randn(B, S, h_kv, d_v)
    start = [0, 9, 28]
    slots = torch.cat([slots_of(table, page_size, b, range(start[b], start[b] + S)) for b in range(B)])
    k_ref, v_ref, k_before = k_pages.clone(), v_pages.clone(), k_pages.clone()
    write_kv_slots(k_pages, v_pages, k.flatten(0, 1), v.flatten(0, 1), slots)
    write_kv_slots_reference(k_ref, v_ref, k.flatten(0, 1), v.flatten(0, 1), slots)
    assert torch.equal(k_pages, k_ref) and torch.equal(v_pages, v_ref)
    for b in range(B):  # independent check: sequence b read back through its pages
        tokens = k_pages[table[b].long()].flatten(0, 1)[start[b]:start[b] + S]
        assert torch.equal(tokens, k[b])
    untouched = sorted(set(range(12)) - set(table.flatten().tolist()))  # pages of no sequence
    assert torch.equal(k_pages[untouched], k_before[untouched])


def test_bad_inputs_raise_clear_errors():
    q, pages, table = torch.randn(4, 3, 16), torch.randn(4, 16, 2, 16), torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_prefill_attention(q, pages, pages, lens([0, 4]), lens([4]), table, 0.25)
    with pytest.raises(ValueError, match="int32"):
        decode_attention(q[:1, :2], pages, pages, torch.tensor([4]), table, 0.25)
    with pytest.raises(ValueError, match="same dtype|one dtype"):
        decode_attention(q[:1, :2].half(), pages, pages, lens([4]), table, 0.25)
    with pytest.raises(ValueError, match=f"block_table must be an int32 tensor \\[1, max_pages\\] on {q.device}; got None"):
        decode_attention(q[:1, :2], pages, pages, lens([4]), None, 0.25)


def _constexpr_kwargs(kwargs: dict) -> dict:
    """The constexpr arguments (upper-case names) and launch options of a launch given by keyword
    (`common.Launch` passes every argument so)."""
    return {k: v for k, v in kwargs.items() if k.isupper() or k in ("num_warps", "num_stages")}


class LaunchSpy:
    """Stands in for a @triton.jit kernel: records each launch's constexpr kwargs, then launches."""
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(_constexpr_kwargs(kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_prefill_explicit_config_is_launched_and_matches_reference(monkeypatch):
    from tritonq.kernels import attention
    B, S, h, h_kv, d_qk, d_v = 3, 33, 4, 2, 72, 40  # a ragged qk tail, Dv off the block size
    q, k, v = torch.randn(B, S, h, d_qk), torch.randn(B, S, h_kv, d_qk), torch.randn(B, S, h_kv, d_v)
    spy = LaunchSpy(attention._paged_prefill_kernel)
    monkeypatch.setattr(attention.launch, "_paged_prefill_kernel", spy)
    args = paged_prompts(q, k, v, SEQ_LENS, 16)
    out = paged_prefill_attention(*args, 0.2, config=attention.PrefillConfig(32, 16, 8, 3))
    assert [(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) for c in spy.launches] == [(32, 16, 8, 3)]
    assert_close(out, paged_prefill_attention_reference(*args, 0.2), torch.float32)
    cu = args[3]
    for b, n in enumerate(SEQ_LENS):
        assert_close(out[cu[b]:cu[b + 1]], sdpa(q[b, :n], k[b, :n], v[b, :n], 0.2, causal=True), torch.float32)


@pytest.mark.parametrize("page_size", [16, 32])
def test_decode_explicit_config_is_launched_and_matches_reference(monkeypatch, page_size):
    from tritonq.kernels import attention
    g = torch.Generator().manual_seed(3)
    B, h, h_kv, d_qk, d_v = len(CACHE_LENS), 8, 2, 72, 40
    q = randn(B, h, d_qk, generator=g)
    k, v = randn(B, S_MAX, h_kv, d_qk, generator=g), randn(B, S_MAX, h_kv, d_v, generator=g)
    k, v, table = paged_cache(k, v, page_size, 80, g)
    spy = LaunchSpy(attention._decode_split_kernel)
    monkeypatch.setattr(attention.launch, "_decode_split_kernel", spy)
    cfg = attention.DecodeConfig(BLOCK_N=16, NUM_SPLITS=3, num_warps=8, num_stages=3)
    out = decode_attention(q, k, v, lens(CACHE_LENS), table, 0.15, config=cfg)
    assert [(c["BLOCK_N"], c["NUM_SPLITS"], c["num_warps"], c["num_stages"]) for c in spy.launches] == [(16, 3, 8, 3)]
    assert_close(out, decode_attention_reference(q, k, v, lens(CACHE_LENS), table, 0.15), torch.float32)


def test_bad_attention_configs_raise_clear_errors():
    from tritonq.kernels.attention import DecodeConfig, PrefillConfig
    q, pages = torch.randn(4, 2, 16), torch.randn(4, 16, 2, 16)
    table, cu = torch.tensor([[2]], dtype=torch.int32), lens([0, 4])
    for cfg, message in [(PrefillConfig(48, 16, 4, 2), "BLOCK_M = 48, expected a power of two >= 16"),
                         (PrefillConfig(64, 8, 4, 2), "BLOCK_N = 8"),
                         (PrefillConfig(64, 64, 3, 2), "num_warps = 3"),
                         (PrefillConfig(64, 64, 4, 0), "num_stages = 0")]:
        with pytest.raises(ValueError, match=message):
            paged_prefill_attention(q, pages, pages, cu, lens([4]), table, 0.25, config=cfg)
    with pytest.raises(TypeError, match="must be a PrefillConfig"):
        paged_prefill_attention(q, pages, pages, cu, lens([4]), table, 0.25, config={"BLOCK_M": 64})
    with pytest.raises(ValueError, match="NUM_SPLITS = 0"):
        decode_attention(q[:1], pages, pages, lens([4]), table, 0.25, config=DecodeConfig(16, 0, 4, 2))
    with pytest.raises(TypeError, match="must be a DecodeConfig"):
        decode_attention(q[:1], pages, pages, lens([4]), table, 0.25, config=PrefillConfig(64, 64, 4, 2))
    with pytest.raises(ValueError, match="exceeds the KV cache page size 16"):
        decode_attention(q[:1], pages, pages, lens([4]), table, 0.25, config=DecodeConfig(32, 1, 4, 2))


# ---- Engine kernels: write by slot, prefill over a paged context, sliding window, static decode configs ----

def visible_mask(positions, n_keys, window):
    """transformers' sliding-window convention, written out: key j is visible to the query at position p
    iff j <= p and (no window or p - j < window). positions [L] -> bool [L, n_keys]."""
    p, j = positions[:, None], torch.arange(n_keys)[None, :]
    return (j <= p) & ((p - j < window) if window else True)


def masked_sdpa(q, k, v, scale, mask):
    """q [L,H,Dqk], k [L',Hkv,Dqk], v [L',Hkv,Dv], mask bool [L, L'] -> [L,H,Dv] float32 via torch SDPA."""
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                         v.float().transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def paged_context(ctx_lens, h_kv, d_qk, d_v, page_size, dtype, generator, mla=False, nan_before=None):
    """Each sequence's contiguous keys/values plus the same tokens in shuffled pages of a cache whose
    other rows and pages are NaN (a kernel that reads them, or a row past a length, returns NaN).

    mla: one latent cache, v_pages = k_pages[..., :d_v] (a strided view, as the absorbed-MLA path).
    nan_before [B]: also NaN keys/values at positions < nan_before[b] (in the pages only), and -1 in the
    table for pages wholly below it (freed by the engine), to prove that keys outside every query's
    window are never loaded, nor their table entries.
    Returns (ks, vs: lists of [ctx_b, Hkv, D]), k_pages, v_pages, block_table [B, max_pages] int32.
    """
    B = len(ctx_lens)
    per_seq = [-(-n // page_size) for n in ctx_lens]
    max_pages = max(per_seq) + 1  # a spare column: the table is wider than any sequence needs
    num_pages = sum(per_seq) + 5
    order = torch.randperm(num_pages, generator=generator, device="cpu").tolist()
    table = torch.full((B, max_pages), -1, dtype=torch.int32)  # -1: unused entries, as the engine pads
    k_pages = torch.full((num_pages, page_size, h_kv, d_qk), float("nan")).to(dtype)
    v_pages = k_pages[..., :d_v] if mla else torch.full((num_pages, page_size, h_kv, d_v), float("nan")).to(dtype)
    ks, vs = [], []
    for b, n in enumerate(ctx_lens):
        table[b, :per_seq[b]] = torch.tensor([order.pop() for _ in range(per_seq[b])], dtype=torch.int32)
        k = randn(n, h_kv, d_qk, generator=generator).to(dtype)
        v = k[..., :d_v] if mla else randn(n, h_kv, d_v, generator=generator).to(dtype)
        pos = torch.arange(n)
        pages, rows = table[b].long()[pos // page_size], pos % page_size
        k_pages[pages, rows] = k
        if not mla:
            v_pages[pages, rows] = v
        if nan_before is not None and nan_before[b] > 0:
            k_pages[pages[:nan_before[b]], rows[:nan_before[b]]] = float("nan")
            v_pages[pages[:nan_before[b]], rows[:nan_before[b]]] = float("nan")
            table[b, :nan_before[b] // page_size] = -1
        ks.append(k)
        vs.append(v)
    return ks, vs, k_pages, v_pages, table


def packed_queries(q_lens, h, d_qk, dtype, generator):
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    return randn(sum(q_lens), h, d_qk, generator=generator).to(dtype), cu


# (Dqk, Dv, H, Hkv, page_size, dtype): head dims 64 / 128 / DeepSeek 192-128 / MLA latent 576-512,
# GQA 1 / 4 / 8 (MLA: 8 heads on the latent), pages of 16 and 64 tokens.
PAGED_CASES = [(64, 64, 2, 2, 16, torch.float32), (128, 128, 4, 1, 64, torch.float16),
               (192, 128, 8, 1, 16, torch.float16), (576, 512, 8, 1, 16, torch.float32)]
# Cached prefixes of 0, 17 and 300 tokens; new tokens 20 (two query blocks), 5, and 1 (a resumed decode).
PREFIXES, NEW_TOKENS = [0, 17, 300], [20, 5, 1]


@pytest.mark.parametrize("d_qk,d_v,h,h_kv,page_size,dtype", PAGED_CASES)
def test_paged_prefill_matches_reference_and_sdpa_on_each_sequence(d_qk, d_v, h, h_kv, page_size, dtype):
    g = torch.Generator().manual_seed(4)
    ctx = [p + n for p, n in zip(PREFIXES, NEW_TOKENS)]
    ks, vs, k_pages, v_pages, table = paged_context(ctx, h_kv, d_qk, d_v, page_size, dtype, g, mla=d_qk == 576)
    q, cu = packed_queries(NEW_TOKENS, h, d_qk, dtype, g)
    scale = 0.8 / d_qk ** 0.5
    out = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx), table, scale)
    ref = paged_prefill_attention_reference(q, k_pages, v_pages, cu, lens(ctx), table, scale)
    assert out.shape == (len(q), h, d_v) and out.dtype == dtype
    for b, (prefix, n) in enumerate(zip(PREFIXES, NEW_TOKENS)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = masked_sdpa(q[rows], ks[b], vs[b], scale, visible_mask(torch.arange(prefix, prefix + n), ctx[b], 0))
        assert_close(out[rows], expected, dtype)
        assert_close(ref[rows], expected, dtype)


# Windows: below the 16-token key block, crossing 16-token pages, and longer than every sequence.
@pytest.mark.parametrize("window", [5, 40, 1000])
def test_paged_prefill_sliding_window_matches_masked_sdpa_and_skips_old_blocks(window):
    g = torch.Generator().manual_seed(5)
    page_size, h, h_kv, d, dtype = 16, 4, 2, 64, torch.float32
    ctx = [p + n for p, n in zip(PREFIXES, NEW_TOKENS)]
    # Keys before the first query's window are NaN: loading any of them would show.
    skip = [max(p - window + 1, 0) for p in PREFIXES]
    ks, vs, k_pages, v_pages, table = paged_context(ctx, h_kv, d, d, page_size, dtype, g, nan_before=skip)
    q, cu = packed_queries(NEW_TOKENS, h, d, dtype, g)
    out = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx), table, 0.125, window=window)
    for b, (prefix, n) in enumerate(zip(PREFIXES, NEW_TOKENS)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = masked_sdpa(q[rows], ks[b], vs[b], 0.125, visible_mask(torch.arange(prefix, prefix + n), ctx[b],
                                                                          window))
        assert_close(out[rows], expected, dtype)
    if window == 40:
        assert skip[2] == 261  # the 300-token prefix really had keys and pages to skip
    # The reference masks, it does not skip: give it finite values (a -1 entry reads the last page).
    ref = paged_prefill_attention_reference(q, torch.nan_to_num(k_pages), torch.nan_to_num(v_pages), cu, lens(ctx),
                                            table, 0.125, window)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("window", [5, 40])
def test_decode_sliding_window_matches_sdpa_over_the_last_keys(page_size, window):
    """The query at position n - 1 sees keys n - window .. n - 1; older pages (NaN here) are not loaded."""
    g = torch.Generator().manual_seed(6)
    h, h_kv, d_qk, d_v, dtype = 8, 2, 96, 64, torch.float16
    q = randn(len(CACHE_LENS), h, d_qk, generator=g).to(dtype)
    skip = [max(n - window, 0) for n in CACHE_LENS]
    ks, vs, k_pages, v_pages, table = paged_context(CACHE_LENS, h_kv, d_qk, d_v, page_size, dtype, g,
                                                    nan_before=skip)
    out = decode_attention(q, k_pages, v_pages, lens(CACHE_LENS), table, 0.1, window=window)
    for b, n in enumerate(CACHE_LENS):
        expected = masked_sdpa(q[b, None], ks[b], vs[b], 0.1, visible_mask(torch.tensor([n - 1]), n, window))[0]
        assert_close(out[b], expected, dtype)
    # The reference masks, it does not skip: give it finite values (its gather clamps -1 entries).
    ref = decode_attention_reference(q, torch.nan_to_num(k_pages), torch.nan_to_num(v_pages), lens(CACHE_LENS),
                                     table, 0.1, window)
    assert_close(out, ref, dtype)


def test_write_kv_slots_skips_negative_slots_and_writes_the_mla_latent_view():
    g = torch.Generator().manual_seed(7)
    page_size, h_kv, d_qk, d_v = 16, 2, 24, 40
    k_pages = randn(6, page_size, h_kv, d_qk, generator=g)
    v_pages = randn(6, page_size, h_kv, d_v, generator=g)
    slots = torch.tensor([37, -1, 0, 95, -1, 16], dtype=torch.int64)  # pages 2, 0, 5, 1; two padding rows
    k, v = randn(6, h_kv, d_qk, generator=g), randn(6, h_kv, d_v, generator=g)
    before_k, before_v = k_pages.clone(), v_pages.clone()
    ref_k, ref_v = k_pages.clone(), v_pages.clone()
    write_kv_slots(k_pages, v_pages, k, v, slots)
    write_kv_slots_reference(ref_k, ref_v, k, v, slots)
    assert torch.equal(k_pages, ref_k) and torch.equal(v_pages, ref_v)
    expected_k, expected_v = before_k.clone(), before_v.clone()  # independent: row by row
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // page_size, slot % page_size] = k[t]
            expected_v[slot // page_size, slot % page_size] = v[t]
    assert torch.equal(k_pages, expected_k) and torch.equal(v_pages, expected_v)
    # MLA: one latent cache [P, 16, 1, 576] and v = its first 512 lanes, a strided view.
    latent = torch.zeros(3, page_size, 1, 576)
    x = randn(3, 1, 576, generator=g)
    write_kv_slots(latent, latent[..., :512], x, x[..., :512], torch.tensor([5, -1, 40], dtype=torch.int64))
    assert torch.equal(latent[0, 5], x[0]) and torch.equal(latent[2, 8], x[2])
    assert latent.count_nonzero() == 2 * 576


class RecordingSpy:
    """Stands in for a @triton.jit kernel: records the grid and constexpr kwargs of each launch, launches nothing."""
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((tuple(grid), _constexpr_kwargs(kwargs)))


@pytest.mark.parametrize("page_size,window", [(16, 0), (16, 160), (64, 0)])
def test_decode_launch_config_is_the_same_for_every_cache_length(monkeypatch, page_size, window):
    """#18: NUM_SPLITS, blocks and grid follow capacity, not cache_lens, so a growing sequence never
    recompiles; with max_seq_len they also ignore the block table's width (the engine's may grow).
    The keys a query sees (capacity, or the window) exceed 128 = 4 tiles of 32 keys, the fewest a split
    takes on a GPU, so there are several splits on every device (the interpreter's tiles are 16 keys)."""
    from tritonq.kernels import attention
    split, merge = RecordingSpy(), RecordingSpy()
    monkeypatch.setattr(attention.launch, "_decode_split_kernel", split)
    monkeypatch.setattr(attention.launch, "_decode_merge_kernel", merge)
    max_seq_len, B, h, h_kv, d = 320, 2, 4, 2, 64
    q = torch.randn(B, h, d)
    for n in range(1, max_seq_len + 1):
        width = -(-n // page_size)  # a table just wide enough for the current length
        pages = torch.zeros(2 * width, page_size, h_kv, d)
        table = torch.arange(2 * width, dtype=torch.int32).view(B, width)
        decode_attention(q, pages, pages, lens([n, 1]), table, 0.1, window=window, max_seq_len=max_seq_len)
    for spy in (split, merge):
        assert len(spy.launches) == max_seq_len
        assert all(launch == spy.launches[0] for launch in spy.launches), spy.launches[0]
    assert split.launches[0][1]["NUM_SPLITS"] > 1  # the capacity spans several splits


def test_engine_kernels_reject_bad_inputs():
    """Checks of shapes, dtypes and arguments: host checks on every device."""
    q, pages = torch.randn(5, 4, 16), torch.randn(4, 16, 2, 16)
    table, cu = torch.zeros(2, 2, dtype=torch.int32), lens([0, 3, 5])
    with pytest.raises(ValueError, match="cu_seqlens_q must be an int32 tensor of shape \\[3\\]"):
        paged_prefill_attention(q, pages, pages, cu.long(), lens([3, 2]), table, 0.1)
    with pytest.raises(ValueError, match="window = -1"):
        paged_prefill_attention(q, pages, pages, cu, lens([3, 2]), table, 0.1, window=-1)
    with pytest.raises(ValueError, match="page_size .* = 12"):
        paged_prefill_attention(q, pages[:, :12], pages[:, :12], cu, lens([3, 2]), table, 0.1)
    with pytest.raises(ValueError, match="slot_mapping must be an int64"):
        write_kv_slots(pages, pages, q[:, :2], q[:, :2], torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seq_len = 0"):
        decode_attention(q[:2], pages, pages, lens([3, 2]), table, 0.1, max_seq_len=0)


def test_engine_kernels_reject_bad_lengths_and_slots_on_cpu_tensors():
    """Checks of values (lengths, slots): host checks for CPU tensors. On a GPU they are torch._assert_async, a
    device-side assert that raises nothing here and fails every later CUDA call of the process, so these cases
    run on explicit CPU tensors only (tests/fake_gpu.py reports a test that expects an exception after one)."""
    with torch.device("cpu"):  # not the test's device (see the docstring)
        q, pages = torch.randn(5, 4, 16), torch.randn(4, 16, 2, 16)
        table, cu = torch.zeros(2, 2, dtype=torch.int32), lens([0, 3, 5])
        with pytest.raises(ValueError, match="q_len_b <= context_lens\\[b\\] <= block_table width x page_size = 32"):
            paged_prefill_attention(q, pages, pages, cu, lens([2, 2]), table, 0.1)  # 3 new tokens, context 2
        with pytest.raises(ValueError, match="got cu_seqlens_q \\[0, 3, 4\\]"):
            paged_prefill_attention(q, pages, pages, lens([0, 3, 4]), lens([3, 2]), table, 0.1)  # T is 5
        with pytest.raises(ValueError, match="context_lens \\[3, 33\\]"):
            paged_prefill_attention(q, pages, pages, cu, lens([3, 33]), table, 0.1)  # past the table's 2 pages
        with pytest.raises(ValueError, match="< num_blocks x block_size = 64"):
            write_kv_slots(pages, pages, q[:, :2], q[:, :2], torch.tensor([0, 1, 2, 3, 64]))
    assert q.device.type == "cpu"


@pytest.mark.parametrize("window", [0, 40])
def test_paged_prefill_key_tiles_longer_than_a_page(window):
    """64-key tiles over 16-token shuffled pages: each key finds its own page (the GPU default shape)."""
    from tritonq.kernels.attention import PrefillConfig
    g = torch.Generator().manual_seed(8)
    ctx = [p + n for p, n in zip(PREFIXES, NEW_TOKENS)]
    skip = [max(p - window + 1, 0) if window else 0 for p in PREFIXES]
    ks, vs, k_pages, v_pages, table = paged_context(ctx, 2, 40, 24, 16, torch.float32, g, nan_before=skip)
    q, cu = packed_queries(NEW_TOKENS, 4, 40, torch.float32, g)
    out = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx), table, 0.15, window=window,
                                  config=PrefillConfig(32, 64, 4, 1))
    for b, (prefix, n) in enumerate(zip(PREFIXES, NEW_TOKENS)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        mask = visible_mask(torch.arange(prefix, prefix + n), ctx[b], window)
        assert_close(out[rows], masked_sdpa(q[rows], ks[b], vs[b], 0.15, mask), torch.float32)


def test_paged_prefill_sequence_without_new_tokens_is_skipped():
    """A sequence with no new tokens this step (q_len 0) owns no query rows; its neighbours are unaffected."""
    g = torch.Generator().manual_seed(9)
    ctx, new = [19, 40, 2], [3, 0, 2]
    ks, vs, k_pages, v_pages, table = paged_context(ctx, 1, 32, 32, 16, torch.float32, g)
    q, cu = packed_queries(new, 2, 32, torch.float32, g)
    out = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx), table, 0.2)
    for b in (0, 2):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        mask = visible_mask(torch.arange(ctx[b] - new[b], ctx[b]), ctx[b], 0)
        assert_close(out[rows], masked_sdpa(q[rows], ks[b], vs[b], 0.2, mask), torch.float32)


# ---------------------------------------------------------------- ALiBi (MPT)

def mpt_alibi(h: int, n_keys: int) -> torch.Tensor:
    """transformers' MPT bias [H, 1, n_keys]: slope_h * (j - (n_keys - 1)), the independent reference."""
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor
    return build_mpt_alibi_tensor(h, n_keys).float()


def alibi_sdpa(q, k, v, scale, positions, n_keys, h):
    """Causal attention with MPT's bias through torch SDPA: a float mask of the bias, -inf above the diagonal."""
    bias = mpt_alibi(h, n_keys).expand(h, len(positions), n_keys)
    mask = bias.masked_fill(~visible_mask(positions, n_keys, 0), float("-inf"))
    return masked_sdpa(q, k, v, scale, mask)


@pytest.mark.parametrize("h", [1, 2, 3, 5, 6, 8, 12, 16, 20])
def test_alibi_slopes_are_mpts_for_any_head_count(h):
    assert torch.equal(alibi_slopes(h, device="cpu"), -mpt_alibi(h, 2)[:, 0, 0].cpu())


@pytest.mark.parametrize("h,h_kv,d", [(6, 2, 64), (5, 5, 72), (12, 4, 64), (3, 1, 96)])
def test_paged_prefill_alibi_matches_mpt_bias_in_sdpa(h, h_kv, d):
    """Odd head counts (3, 5, 6, 12 use the non-power-of-two slope rule), GQA / MQA, cached prefixes of 0, 17
    and 300 tokens with 20, 5 and 1 new ones: each query's bias is slope * (key - its position)."""
    g = torch.Generator().manual_seed(11)
    ctx = [p + n for p, n in zip(PREFIXES, NEW_TOKENS)]
    ks, vs, k_pages, v_pages, table = paged_context(ctx, h_kv, d, d, 16, torch.float32, g)
    q, cu = packed_queries(NEW_TOKENS, h, d, torch.float32, g)
    slopes = alibi_slopes(h, device=q.device)
    out = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx), table, 0.125, alibi_slopes=slopes)
    ref = paged_prefill_attention_reference(q, k_pages, v_pages, cu, lens(ctx), table, 0.125, alibi_slopes=slopes)
    for b, (prefix, n) in enumerate(zip(PREFIXES, NEW_TOKENS)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = alibi_sdpa(q[rows], ks[b], vs[b], 0.125, torch.arange(prefix, prefix + n), ctx[b], h)
        assert_close(out[rows], expected, torch.float32)
        assert_close(ref[rows], expected, torch.float32)
    plain = paged_prefill_attention(q, k_pages, v_pages, cu, lens(ctx), table, 0.125)
    assert (plain - out).abs().max() > 1e-2  # the bias matters at these lengths


@pytest.mark.parametrize("h,h_kv,dtype", [(6, 3, torch.float32), (5, 1, torch.float16), (12, 12, torch.float32)])
def test_decode_alibi_matches_mpt_bias_in_sdpa(h, h_kv, dtype):
    g = torch.Generator().manual_seed(12)
    d = 64
    q = randn(len(CACHE_LENS), h, d, generator=g).to(dtype)
    ks, vs, k_pages, v_pages, table = paged_context(CACHE_LENS, h_kv, d, d, 16, dtype, g)
    slopes = alibi_slopes(h, device=q.device)
    out = decode_attention(q, k_pages, v_pages, lens(CACHE_LENS), table, 0.1, alibi_slopes=slopes)
    ref = decode_attention_reference(q, torch.nan_to_num(k_pages), torch.nan_to_num(v_pages), lens(CACHE_LENS),
                                     table, 0.1, alibi_slopes=slopes)
    for b, n in enumerate(CACHE_LENS):
        expected = alibi_sdpa(q[b, None], ks[b], vs[b], 0.1, torch.tensor([n - 1]), n, h)[0]
        assert_close(out[b], expected, dtype)
        assert_close(ref[b], expected, dtype)


def test_alibi_slopes_are_checked(device):
    g = torch.Generator().manual_seed(13)
    ks, vs, k_pages, v_pages, table = paged_context([5], 2, 64, 64, 16, torch.float32, g)
    q = randn(1, 4, 64, generator=g)
    with pytest.raises(ValueError, match=r"alibi_slopes is torch.float32 \(3,\).*expected a contiguous float32 \[4\]"):
        decode_attention(q, k_pages, v_pages, lens([5]), table, 0.1, alibi_slopes=alibi_slopes(3, device=q.device))


# (H, Hkv, Dqk, Dv, window, alibi): GQA 4 with ragged head dims, 80 query heads on one kv head (two head blocks, the
# second partly masked), a window over NaN-filled older pages, MHA with ALiBi.
ONE_SPLIT_CASES = [(8, 2, 72, 40, 0, False), (80, 1, 64, 64, 0, False), (6, 3, 96, 64, 40, False),
                   (6, 6, 64, 64, 0, True)]


@pytest.mark.parametrize("h,h_kv,d_qk,d_v,window,alibi", ONE_SPLIT_CASES)
def test_decode_in_one_split_writes_the_output_itself(monkeypatch, h, h_kv, d_qk, d_v, window, alibi):
    """With one KV split (a batch that fills the GPU) the split kernel normalizes and writes the output: no merge is
    launched, and each sequence (odd lengths, shuffled pages, NaN outside them; a padding row of length 0 gives
    zeros) equals SDPA over its visible keys."""
    from tritonq.kernels import attention
    merge = RecordingSpy()
    monkeypatch.setattr(attention.launch, "_decode_merge_kernel", merge)
    g = torch.Generator().manual_seed(11)
    cache_lens, dtype, scale = [1, 65, 300, 0], torch.float16, 0.9 / d_qk ** 0.5
    skip = [max(n - window, 0) if window else 0 for n in cache_lens]
    ks, vs, k_pages, v_pages, table = paged_context(cache_lens, h_kv, d_qk, d_v, 16, dtype, g, nan_before=skip)
    q = randn(len(cache_lens), h, d_qk, generator=g).to(dtype)
    slopes = alibi_slopes(h) if alibi else None
    cfg = attention.DecodeConfig(BLOCK_N=16, NUM_SPLITS=1, num_warps=4, num_stages=1)
    out = decode_attention(q, k_pages, v_pages, lens(cache_lens), table, scale, window=window, config=cfg,
                           alibi_slopes=slopes)
    assert merge.launches == []
    for b, n in enumerate(cache_lens[:-1]):
        positions = torch.tensor([n - 1])
        if alibi:
            expected = alibi_sdpa(q[b, None], ks[b], vs[b], scale, positions, n, h)[0]
        else:
            expected = masked_sdpa(q[b, None], ks[b], vs[b], scale, visible_mask(positions, n, window))[0]
        assert_close(out[b], expected, dtype)
    assert out[-1].abs().max() == 0
