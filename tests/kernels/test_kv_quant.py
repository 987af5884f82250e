"""Quantized KV pages (kernels/attention/pages.py QuantizedPages: fp8 e4m3 per tensor, int8 per token and kv head)
through the Triton kernels (the interpreter on CPU, natively on a GPU).

The write is checked against what the format means, not against our reference: fp8 bytes equal torch's own
round-to-nearest cast of x / scale (saturated at +-448), bit for bit; int8 scales equal absmax / 127 and every
code is the value's nearest (|code x scale - x| <= scale / 2). Attention over quantized pages is checked
against torch SDPA (float32) over the dequantized values: the kernels convert codes exactly into the dot's dtype
(|int8| <= 127 and e4m3 values are fp16 / bf16 values) and apply the scales in fp32 to the scores and
probabilities, so what is left is the unquantized kernels' own error, and the tolerance is theirs
(tests/tolerances.py "attention"). Shapes: odd head dims (72, 40), GQA 4, MQA, MLA's latent (v = k[..., :Dv],
one shared int8 scale), pages of 16 and 32, a sliding window, lengths that end mid-page.
"""
import pytest
import torch
import torch.nn.functional as F
import tolerances

from tritonq.kernels.attention import (
    KV_FP8_MAX,
    KV_INT8_MAX,
    DecodeConfig,
    PrefillConfig,
    QuantizedPages,
    decode_attention,
    dequantize_pages,
    paged_prefill_attention,
    write_kv_slots,
)

TOL = tolerances.table("attention")
KINDS = ["int8", "fp8"]
# (Dqk, Dv, H, Hkv, latent): GQA 2 with odd dims, GQA 4 with one kv head, MLA's latent 80 / 64 (v inside k,
# one shared scale)
HEADS = [(72, 40, 4, 2, False), (64, 64, 4, 1, False), (80, 64, 2, 1, True)]
# (page size, sliding window, dtype of q): 16-token pages, 32-token pages with a window (fp16: the probabilities
# times the value scales rounded to fp16 before the PV dot, as unquantized probabilities are)
LAYOUTS = [(16, 0, torch.float32), (32, 7, torch.float16)]


def randn(*shape, generator, scale=1.0):
    """Seeded N(0, scale^2) drawn on the CPU (a CPU generator cannot fill a device tensor), moved to the test's device."""
    return (torch.randn(*shape, generator=generator, device="cpu") * scale).to(torch.get_default_device())


def empty_pages(kind, num_pages, page_size, h_kv, d_qk, d_v, latent, fp8_scales=(0.02, 0.03)):
    """Zeroed QuantizedPages for k and v; fp8 with per-tensor scales (k, v), MLA's v a view sharing k's scale."""
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    device = torch.get_default_device()
    k_data = torch.zeros(num_pages, page_size, h_kv, d_qk, dtype=dtype, device=device)
    v_data = k_data[..., :d_v] if latent else torch.zeros(num_pages, page_size, h_kv, d_v, dtype=dtype, device=device)

    def scale(value):
        if kind == "int8":
            return torch.zeros(num_pages, page_size, h_kv, device=device)
        return torch.tensor(value, device=device)
    k = QuantizedPages(k_data, scale(fp8_scales[0]))
    return k, QuantizedPages(v_data, k.scale if latent else scale(fp8_scales[1]))


def filled_cache(kind, d_qk, d_v, h_kv, latent, lens, page_size, g):
    """Pages written by write_kv_slots with len(lens) sequences of lens[b] tokens in shuffled pages, their block
    table, and each sequence's (page, row) per position: (k, v, table, rows)."""
    per_seq = -(-max(lens) // page_size)
    num_pages = len(lens) * per_seq + 3
    k_pages, v_pages = empty_pages(kind, num_pages, page_size, h_kv, d_qk, d_v, latent)
    order = torch.randperm(num_pages, generator=g, device="cpu")[:len(lens) * per_seq].view(len(lens), per_seq)
    table = order.to(torch.int32).to(torch.get_default_device())
    k = randn(sum(lens), h_kv, d_qk, generator=g, scale=2.0)
    v = k[..., :d_v].contiguous() if latent else randn(sum(lens), h_kv, d_v, generator=g)
    pos = [torch.arange(n, device="cpu") for n in lens]
    slots = torch.cat([order[b, p // page_size] * page_size + p % page_size for b, p in enumerate(pos)])
    write_kv_slots(k_pages, v_pages, k, v, slots.to(torch.get_default_device()))  # one step writes them all
    return k_pages, v_pages, table, [(order[b, p // page_size], p % page_size) for b, p in enumerate(pos)]


def sequence_values(pages: QuantizedPages, rows) -> list[torch.Tensor]:
    """float32 [n, Hkv, D] per sequence: what its positions' codes x scales are (read back after the kernel ran,
    so that a run without data, tests/fake_gpu.py, still reaches the launch)."""
    values = dequantize_pages(pages).cpu()
    return [values[page, row] for page, row in rows]


def sdpa(q, k, v, scale, visible):
    """q [L, H, Dqk], k [n, Hkv, Dqk], v [n, Hkv, Dv] float32, visible [L, n] -> [L, H, Dv] (GQA)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("latent", [False, True])
def test_write_quantizes_each_row_to_its_nearest_code(kind, latent):
    g = torch.Generator().manual_seed(1)
    page_size, h_kv, d_qk, d_v = 16, 1 if latent else 3, 40 if latent else 24, 32
    k_pages, v_pages = empty_pages(kind, 4, page_size, h_kv, d_qk, d_v, latent)
    k = randn(9, h_kv, d_qk, generator=g, scale=3.0)
    k[0, 0, 0] = 50.0  # beyond fp8's 448 x 0.02: saturates to 448
    k[1] = 0.0  # an all-zero row: finite scale, zero codes
    v = k[..., :d_v].contiguous() if latent else randn(9, h_kv, d_v, generator=g)
    slots = torch.tensor([3, 17, -1, 40, 63, 0, 20, -1, 33], device="cpu").to(torch.get_default_device())
    write_kv_slots(k_pages, v_pages, k, v, slots)
    kept = slots >= 0
    for pages, x in ((k_pages, k), (v_pages, v)):
        data = pages.data.flatten(0, 1)[slots[kept]].cpu()
        x = x[kept].cpu()
        if kind == "fp8":  # torch's own cast (round to nearest even) of the scaled, saturated values
            expected = (x / pages.scale.cpu()).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(torch.float8_e4m3fn)
            assert torch.equal(data.view(torch.uint8), expected.view(torch.uint8))
            continue
        scale = pages.scale.flatten(0, 1)[slots[kept]].cpu()
        absmax = k[kept].cpu().abs().amax(-1) if latent else x.abs().amax(-1)  # MLA: one scale over the latent + rope
        torch.testing.assert_close(scale, absmax.clamp(min=1e-10) / KV_INT8_MAX, rtol=1e-6, atol=0)
        error = (data.float() * scale[..., None] - x).abs()
        assert (error <= scale[..., None] / 2 * (1 + 1e-5)).all(), error.max()
    assert k_pages.data.view(torch.uint8).flatten(0, 1)[[1, 2, 4]].count_nonzero() == 0  # slots never named: untouched
    if kind == "fp8":
        assert k_pages.data.flatten(0, 1)[3, 0, 0].float() == KV_FP8_MAX


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d_qk,d_v,h,h_kv,latent", HEADS)
@pytest.mark.parametrize("page_size,window,dtype", LAYOUTS)
def test_decode_over_quantized_pages_matches_sdpa_over_their_values(kind, d_qk, d_v, h, h_kv, latent, page_size,
                                                                   window, dtype):
    g = torch.Generator().manual_seed(2)
    lens = [1, 21, 40]
    k_pages, v_pages, table, rows = filled_cache(kind, d_qk, d_v, h_kv, latent, lens, page_size, g)
    q = randn(len(lens), h, d_qk, generator=g).to(dtype)
    scale = 0.8 / d_qk ** 0.5
    out = decode_attention(q, k_pages, v_pages, torch.tensor(lens, dtype=torch.int32).to(q.device), table, scale,
                           window=window)
    k_seq, v_seq = sequence_values(k_pages, rows), sequence_values(v_pages, rows)
    assert out.shape == (len(lens), h, d_v) and out.dtype == dtype
    for b, n in enumerate(lens):
        pos = torch.arange(n, device="cpu")
        visible = (pos >= n - window) if window else torch.ones(n, dtype=torch.bool, device="cpu")
        ref = sdpa(q[b:b + 1].float().cpu(), k_seq[b], v_seq[b], scale, visible[None])
        torch.testing.assert_close(out[b:b + 1].float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d_qk,d_v,h,h_kv,latent", [HEADS[0], HEADS[2]])
def test_decode_in_one_split_over_quantized_pages_matches_sdpa(kind, d_qk, d_v, h, h_kv, latent):
    """One KV split (the merge folded into the split kernel): the scales still reach the scores and the output."""
    g = torch.Generator().manual_seed(4)
    lens, window, dtype = [1, 21, 40], 7, torch.float16
    k_pages, v_pages, table, rows = filled_cache(kind, d_qk, d_v, h_kv, latent, lens, 32, g)
    q = randn(len(lens), h, d_qk, generator=g).to(dtype)
    scale = 0.8 / d_qk ** 0.5
    out = decode_attention(q, k_pages, v_pages, torch.tensor(lens, dtype=torch.int32).to(q.device), table, scale,
                           window=window, config=DecodeConfig(BLOCK_N=16, NUM_SPLITS=1, num_warps=4, num_stages=1))
    k_seq, v_seq = sequence_values(k_pages, rows), sequence_values(v_pages, rows)
    for b, n in enumerate(lens):
        visible = torch.arange(n, device="cpu") >= n - window
        ref = sdpa(q[b:b + 1].float().cpu(), k_seq[b], v_seq[b], scale, visible[None])
        torch.testing.assert_close(out[b:b + 1].float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d_qk,d_v,h,h_kv,latent", HEADS)
@pytest.mark.parametrize("page_size,window,dtype", LAYOUTS)
@pytest.mark.parametrize("v_pairs", [False, True])
def test_prefill_over_quantized_pages_matches_sdpa_over_their_values(kind, d_qk, d_v, h, h_kv, latent, page_size,
                                                                    window, dtype, v_pairs):
    """Sequences of 5 new tokens after 0, 15 and 36 cached ones (context 5, 20, 41), causal over the cache; V tiles
    as bytes (sm_90's prefill) and as byte pairs (PrefillConfig.v_pairs, before sm_90)."""
    g = torch.Generator().manual_seed(3)
    lens, new = [5, 20, 41], 5
    k_pages, v_pages, table, rows = filled_cache(kind, d_qk, d_v, h_kv, latent, lens, page_size, g)
    q = randn(new * len(lens), h, d_qk, generator=g).to(dtype)
    cu = torch.arange(0, new * len(lens) + 1, new, dtype=torch.int32).to(q.device)
    scale = 0.8 / d_qk ** 0.5
    config = PrefillConfig(16, 16, 1, 1, v_pairs=v_pairs)  # the interpreter's default tiles
    out = paged_prefill_attention(q, k_pages, v_pages, cu, torch.tensor(lens, dtype=torch.int32).to(q.device),
                                  table, scale, window=window, config=config)
    k_seq, v_seq = sequence_values(k_pages, rows), sequence_values(v_pages, rows)
    for b, n in enumerate(lens):
        p, j = torch.arange(n - new, n, device="cpu")[:, None], torch.arange(n, device="cpu")[None, :]
        visible = (j <= p) & ((p - j < window) if window else True)
        ref = sdpa(q[b * new:(b + 1) * new].float().cpu(), k_seq[b], v_seq[b], scale, visible)
        torch.testing.assert_close(out[b * new:(b + 1) * new].float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_quantized_pages_are_refused_with_what_was_expected():
    device = torch.get_default_device()
    k, v = empty_pages("int8", 2, 16, 2, 16, 16, False)
    q = torch.zeros(1, 2, 16, device=device)
    lens, table = torch.ones(1, dtype=torch.int32, device=device), torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="both be QuantizedPages or both plain tensors"):
        decode_attention(q, k, v.data.float(), lens, table, 1.0)
    with pytest.raises(ValueError, match=r"scale must be float32 \(per token and kv head, \[2, 16, 2\]"):
        decode_attention(q, QuantizedPages(k.data, torch.zeros(2, 16, device=device)), v, lens, table, 1.0)
    with pytest.raises(ValueError, match=r"scale must be float32 \(per tensor, \[\]\)"):
        fp8 = QuantizedPages(k.data.to(torch.float8_e4m3fn), torch.ones(2, device=device))
        decode_attention(q, fp8, fp8, lens, table, 1.0)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn pages"):
        decode_attention(q, QuantizedPages(k.data.half(), k.scale), v, lens, table, 1.0)
    odd = QuantizedPages(v.data[..., :15], v.scale)  # Dv 15: the kernels read 8-bit values as byte pairs
    with pytest.raises(ValueError, match=r"read as byte pairs .* got Dv 15"):
        decode_attention(q, k, odd, lens, table, 1.0)
    with pytest.raises(ValueError, match="8-bit pages take fp16/bf16/fp32 k and v of one dtype"):
        write_kv_slots(k, v, torch.zeros(1, 2, 16, device=device), torch.zeros(1, 2, 16, device=device).half(),
                       torch.zeros(1, dtype=torch.int64, device=device))
