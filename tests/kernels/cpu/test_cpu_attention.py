"""The CPU attention backend (kernels/cpu/attention.py) against the float32 torch references.

Lengths 1, 3, 17, 64 and 100 (partial and whole 16-token pages, a sequence of one token), a decode
row with no keys, GQA ratios 1, 2, 4 and MQA, head dims 72 and 96 (not powers of two), DeepSeek-V2's
192 / 128 and MLA's 576 / 512 with v a strided view of the k pages; sliding windows shorter and
longer than a page; pages shuffled in a pool larger than needed. Everything a query must not see
is poisoned: the rows of its pages outside its keys hold NaN and the block table entries outside
them are -1, so a path that read them would fail; the reference runs on the clean cache.
Tolerances (tests/tolerances.py "attention"): fp32 summation order; bf16 the probabilities
rounded to bf16 before the PV product and the output rounded once, as the Triton kernels.
The write of new keys into the pages is a copy: bitwise equal to the reference. The gather plan shared by
the layers of a step is reused only while its lengths, window and block table are unchanged.
Decode runs the C kernel (kernels/cpu/native.py) where it takes the call and torch's flash kernel over gathered
keys otherwise: the decode test runs both (`path`); the tests of the gather plan, the grouped calls and the thread
count are about the torch path and pin it. tests/kernels/cpu/test_cpu_native.py tests the C kernel's own cases.
"""
import pytest
import torch
import tolerances

from tritonq.kernels import attention
from tritonq.kernels.cpu import attention as cpu_attention, native as cpu_native
from tritonq.kernels.attention import (decode_attention, decode_attention_reference, paged_cache,
                                       paged_prefill_attention, paged_prefill_attention_reference, write_kv_slots,
                                       write_kv_slots_reference)

TOL = tolerances.table("attention")
PAGE = 16
# (Dqk, Dv, H, Hkv): GQA 1, 2, 4, MQA; odd head dims; DeepSeek-V2; MLA latent (v = k[..., :512])
HEADS = [(64, 64, 4, 4), (64, 64, 4, 2), (72, 72, 8, 2), (96, 96, 4, 1), (192, 128, 2, 2), (576, 512, 4, 1)]
DECODE_LENS = [1, 3, 17, 64, 100, 0]  # 0: a padding row, no keys
# Prefill: (new tokens, context) per sequence; whole prompts and chunks after a cached prefix
PREFILL = [(1, 1), (3, 3), (17, 17), (64, 64), (1, 40), (6, 100), (17, 33)]
WINDOWS = [0, 5, 20]
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)


@pytest.fixture
def torch_path(monkeypatch):
    """Prefill and decode through torch's flash kernel over gathered keys, as where the C kernel cannot be built."""
    monkeypatch.setattr(cpu_native, "paged_attention", lambda *args, **kwargs: None)


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Prefill and decode through the C kernel where it takes the call (it must, for plain pages of q's dtype), or
    the torch path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_native, "paged_attention", lambda *args, **kwargs: None)
    return request.param


def cache(d_qk, d_v, h_kv, lens, dtype, g):
    """Shuffled pages holding len(lens) sequences of up to max(lens) tokens (MLA: v a view of k)."""
    S = max(lens)
    k = torch.randn(len(lens), S, h_kv, d_qk, generator=g).to(dtype)
    v = torch.randn(len(lens), S, h_kv, d_v, generator=g).to(dtype)
    num_pages = len(lens) * -(-S // PAGE) + 5
    k_pages, v_pages, table = paged_cache(k, v, PAGE, num_pages=num_pages, generator=g)
    if d_qk == 576 and d_v == 512:
        v_pages = k_pages[..., :512]
    return k_pages, v_pages, table


def poisoned(k_pages, v_pages, table, seen):
    """Copies where every key outside seen[b] = (first, last) of each sequence b is NaN and every block
    table entry outside its pages -1."""
    k_bad = torch.full_like(k_pages, float("nan"))
    v_bad = k_bad[..., :v_pages.shape[-1]] if v_pages.data_ptr() == k_pages.data_ptr() else torch.full_like(
        v_pages, float("nan"))
    table_bad = torch.full_like(table, -1)
    for b, (first, last) in enumerate(seen):
        for n in range(first, last):
            page, row = int(table[b, n // PAGE]), n % PAGE
            k_bad[page, row], v_bad[page, row] = k_pages[page, row], v_pages[page, row]
        pages = slice(first // PAGE, -(-last // PAGE))
        table_bad[b, pages] = table[b, pages]
    return k_bad, v_bad, table_bad


def assert_close(got, ref, dtype):
    assert got.dtype == ref.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("d_qk,d_v,h,h_kv", HEADS)
def test_decode_matches_reference_reading_only_each_sequences_keys(d_qk, d_v, h, h_kv, window, dtype, path):
    g = torch.Generator().manual_seed(0)
    k_pages, v_pages, table = cache(d_qk, d_v, h_kv, DECODE_LENS, dtype, g)
    q = torch.randn(len(DECODE_LENS), h, d_qk, generator=g).to(dtype)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    scale = 0.7 / d_qk ** 0.5
    ref = decode_attention_reference(q, k_pages, v_pages, lens, table, scale, window)
    seen = [(max(0, n - window) if window else 0, n) for n in DECODE_LENS]
    k_bad, v_bad, table_bad = poisoned(k_pages, v_pages, table, seen)
    got = cpu_attention.decode_attention(q, k_bad, v_bad, lens, table_bad, scale, window)
    assert_close(got, ref, dtype)
    assert (got[DECODE_LENS.index(0)] == 0).all()
    if path == "native" and d_qk == d_v:  # the C kernel takes plain pages of q's dtype
        assert cpu_native.decode_attention(q, k_bad, v_bad, lens, table_bad, scale, window) is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("d_qk,d_v,h,h_kv", HEADS)
def test_prefill_after_cached_prefix_matches_reference_reading_only_visible_keys(d_qk, d_v, h, h_kv, window,
                                                                                  dtype, path):
    g = torch.Generator().manual_seed(1)
    q_lens, ctx = zip(*PREFILL)
    k_pages, v_pages, table = cache(d_qk, d_v, h_kv, ctx, dtype, g)
    q = torch.randn(sum(q_lens), h, d_qk, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    scale = 0.7 / d_qk ** 0.5
    ref = paged_prefill_attention_reference(q, k_pages, v_pages, cu, context_lens, table, scale, window)
    seen = [(max(0, c - n - window + 1) if window else 0, c) for n, c in PREFILL]
    k_bad, v_bad, table_bad = poisoned(k_pages, v_pages, table, seen)
    got = cpu_attention.paged_prefill_attention(q, k_bad, v_bad, cu, context_lens, table_bad, scale, window)
    assert_close(got, ref, dtype)
    if path == "native" and d_qk == d_v:  # the C kernel takes plain pages of q's dtype
        assert cpu_native.paged_attention(q, k_bad, v_bad, cu, context_lens, table_bad, scale, window) is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("skipped", [0, 1, 5])
@pytest.mark.parametrize("T", [1, 3, 17, 64])
@pytest.mark.parametrize("d_qk,d_v,h,h_kv", HEADS)
def test_write_kv_slots_equals_reference_bitwise(d_qk, d_v, h, h_kv, T, skipped, dtype):
    """Shuffled slots over a pool of pages, the first `skipped` (at most T - 1 of them, shuffled in) -1;
    MLA: v is a view of the k pages and the written v the latent k[..., :512], as deepseek_v2 writes it."""
    g = torch.Generator().manual_seed(4)
    ref_k, ref_v, _ = cache(d_qk, d_v, h_kv, [70, 70], dtype, g)
    got_k = ref_k.clone()
    got_v = got_k[..., :512] if d_v == 512 else ref_v.clone()
    k = torch.randn(T, h_kv, d_qk, generator=g).to(dtype)
    v = k[..., :d_v] if d_v == 512 else torch.randn(T, h_kv, d_v, generator=g).to(dtype)
    slots = torch.randperm(ref_k.shape[0] * PAGE, generator=g)[:T]
    slots[:min(skipped, T - 1)] = -1
    slots = slots[torch.randperm(T, generator=g)]
    write_kv_slots_reference(ref_k, ref_v, k, v, slots)
    cpu_attention.write_kv_slots(got_k, got_v, k, v, slots)
    assert got_k.dtype == got_v.dtype == dtype
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)  # bitwise (randn pages: no NaN)
    assert torch.equal(got_k.flatten(0, 1)[slots[slots >= 0]], k[slots >= 0])


def test_cpu_tensors_run_the_fast_path_and_torch_backend_the_reference(monkeypatch):
    """The launchers' dispatch (attention and the KV write): CPU tensors take cpu_attention by default,
    TRITONQ_BACKEND=torch the references."""
    g = torch.Generator().manual_seed(2)
    k_pages, v_pages, table = cache(64, 64, 2, [17, 3], torch.float32, g)
    q = torch.randn(2, 4, 64, generator=g)
    lens = torch.tensor([17, 3], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    calls = []
    new, slots = torch.randn(2, 2, 64, generator=g), torch.tensor([5, -1])
    names = ("decode_attention", "paged_prefill_attention", "write_kv_slots")
    for name in names:
        monkeypatch.setattr(cpu_attention, name, lambda *a, name=name, **k: calls.append(f"cpu {name}"))
        monkeypatch.setattr(attention.launch, f"{name}_reference",  # where the launchers look it up
                            lambda *a, name=name, **k: calls.append(f"ref {name}"))
    for backend in ("auto", "torch"):
        monkeypatch.setenv("TRITONQ_BACKEND", backend)
        decode_attention(q, k_pages, v_pages, lens, table, 0.1)
        paged_prefill_attention(q, k_pages, v_pages, cu, lens, table, 0.1)
        write_kv_slots(k_pages, v_pages, new, new, slots)
    assert calls == [f"{path} {name}" for path in ("cpu", "ref") for name in names]


@pytest.mark.usefixtures("torch_path")
def test_small_calls_run_on_one_thread_and_restore_the_thread_count(monkeypatch):
    """Below PARALLEL_WORK the per-sequence loop runs on one intra-op thread (see cpu_attention's docstring);
    the caller's thread count comes back afterwards."""
    g = torch.Generator().manual_seed(3)
    k_pages, v_pages, table = cache(64, 64, 2, [17, 3], torch.float32, g)
    q = torch.randn(2, 4, 64, generator=g)
    lens = torch.tensor([17, 3], dtype=torch.int32)
    seen = []
    monkeypatch.setattr(cpu_attention, "_sdpa", lambda q, k, v, *a, **kw: seen.append(torch.get_num_threads())
                        or q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cpu_attention.decode_attention(q, k_pages, v_pages, lens, table, 0.1)
        assert seen == [1, 1] and torch.get_num_threads() == 2
        monkeypatch.setattr(cpu_attention, "PARALLEL_WORK", 1)
        cpu_attention.decode_attention(q, k_pages, v_pages, lens, table, 0.1)
        assert seen[2:] == [2, 2]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.usefixtures("torch_path")
def test_key_plan_is_reused_only_while_lengths_window_and_table_are_the_same(dtype):
    """The gather plan (cpu_attention.key_plan) is shared by the layers of a step: calls with the same lengths,
    window and block table get the same plan; another table (pages shuffled again), lengths or window get a new
    one, and every call matches the reference over its own poisoned cache (a stale plan would read NaN)."""
    g = torch.Generator().manual_seed(5)
    h, h_kv, d = 8, 2, 64
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    q = torch.randn(len(DECODE_LENS), h, d, generator=g).to(dtype)
    plans = []
    for table_seed, window in ((0, 0), (0, 0), (0, 5), (0, 0), (1, 0), (1, 0)):
        k_pages, v_pages, table = cache(d, d, h_kv, DECODE_LENS, dtype, torch.Generator().manual_seed(table_seed))
        seen = [(max(0, n - window) if window else 0, n) for n in DECODE_LENS]
        k_bad, v_bad, table_bad = poisoned(k_pages, v_pages, table, seen)
        for layer in range(2):  # two "layers" of one step
            got = cpu_attention.decode_attention(q, k_bad, v_bad, lens, table_bad, 0.1, window)
            assert_close(got, decode_attention_reference(q, k_pages, v_pages, lens, table, 0.1, window), dtype)
        plans.append(cpu_attention.key_plan(*zip(*seen), table_bad, PAGE))
    assert plans[0] is plans[1] is plans[3]  # same values: the cached plan (window 5's kept beside it)
    assert plans[2] is not plans[0] and plans[4] is not plans[0] and plans[4] is plans[5]
    slots = {group.rows[0]: group.slots.tolist() for group in plans[5].groups}  # one sequence per group
    for b, (first, last) in enumerate(seen):  # the last plan's slots are exactly the rows of each sequence's keys
        expected = [int(table_bad[b, n // PAGE]) * PAGE + n % PAGE for n in range(first, last)]
        assert slots.get(b, []) == expected


GROUPED_LENS = [1, 3, 17, 64, 100, 0, 17, 90, 3]  # groups (slack 1.25): 100+90+64 padded, 17+17, 3+3, 1 alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("d_qk,d_v,h,h_kv", HEADS)
@pytest.mark.usefixtures("torch_path")
def test_grouped_decode_on_several_threads_matches_reference(d_qk, d_v, h, h_kv, window, dtype, monkeypatch):
    """A decode step above GROUPED_WORK on several threads runs sequences of similar lengths in one padded flash
    call each (the padding repeats a sequence's own last key and is masked): equal to the reference over a
    poisoned cache, the row without keys zero; the plan holds padded groups, an unpadded one and a single."""
    monkeypatch.setattr(cpu_attention, "GROUPED_WORK", 1)
    g = torch.Generator().manual_seed(7)
    k_pages, v_pages, table = cache(d_qk, d_v, h_kv, GROUPED_LENS, dtype, g)
    q = torch.randn(len(GROUPED_LENS), h, d_qk, generator=g).to(dtype)
    lens = torch.tensor(GROUPED_LENS, dtype=torch.int32)
    ref = decode_attention_reference(q, k_pages, v_pages, lens, table, 0.1, window)
    seen = [(max(0, n - window) if window else 0, n) for n in GROUPED_LENS]
    k_bad, v_bad, table_bad = poisoned(k_pages, v_pages, table, seen)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_attention.decode_attention(q, k_bad, v_bad, lens, table_bad, 0.1, window)
    finally:
        torch.set_num_threads(before)
    assert_close(got, ref, dtype)
    assert (got[GROUPED_LENS.index(0)] == 0).all()
    groups = cpu_attention.key_plan(*zip(*seen), table_bad, PAGE, cpu_attention.GROUP_KEYS).groups
    assert sum(len(group.rows) for group in groups) == len(GROUPED_LENS) - 1
    if window == 0:
        assert [sorted(group.rows) for group in groups] == [[3, 4, 7], [2, 6], [1, 8], [0]]
        assert groups[0].mask is not None and groups[1].mask is None and groups[3].index is None


# ---- quantized pages (kernels/attention/pages.py QuantizedPages): the same layout, dequantized per sequence --------

def quantized(pages: torch.Tensor, kind: str, g: torch.Generator, scale_of=None) -> attention.QuantizedPages:
    """Random 8-bit pages shaped as `pages` (a view of scale_of's data when given: MLA's latent, shared scale)."""
    if scale_of is not None:
        return attention.QuantizedPages(scale_of.data[..., :pages.shape[-1]], scale_of.scale)
    if kind == "int8":
        data = torch.randint(-127, 128, pages.shape, generator=g, dtype=torch.int8)
        return attention.QuantizedPages(data, torch.rand(pages.shape[:3], generator=g) / 50)
    return attention.QuantizedPages((torch.randn(pages.shape, generator=g) * 50).to(torch.float8_e4m3fn),
                                    torch.tensor(0.02))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d_qk,d_v,h,h_kv", [(72, 72, 8, 2), (576, 512, 4, 1)])
def test_quantized_pages_decode_and_prefill_match_the_reference(kind, dtype, d_qk, d_v, h, h_kv, monkeypatch):
    """Over random codes and scales; bf16: the dequantized rows are rounded to bf16 once (as bf16 K/V are), within
    the attention tolerance. Decode per sequence on one thread and in padded groups on two."""
    g = torch.Generator().manual_seed(6)
    k_plain, v_plain, table = cache(d_qk, d_v, h_kv, DECODE_LENS, dtype, g)
    k_pages = quantized(k_plain, kind, g)
    v_pages = quantized(v_plain, kind, g, scale_of=k_pages if d_v == 512 else None)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    q = torch.randn(len(DECODE_LENS), h, d_qk, generator=g).to(dtype)
    scale = 0.7 / d_qk ** 0.5
    monkeypatch.setattr(cpu_attention, "GROUPED_WORK", 1)
    before = torch.get_num_threads()
    for threads, window in ((1, 0), (1, 5), (2, 0), (2, 5)):
        torch.set_num_threads(threads)
        try:
            got = cpu_attention.decode_attention(q, k_pages.data, v_pages.data, lens, table, scale, window,
                                                 k_pages.scale, v_pages.scale)
        finally:
            torch.set_num_threads(before)
        assert_close(got, decode_attention_reference(q, k_pages, v_pages, lens, table, scale, window), dtype)
    q_lens, ctx = zip(*PREFILL)
    k_plain, v_plain, table = cache(d_qk, d_v, h_kv, ctx, dtype, g)
    k_pages = quantized(k_plain, kind, g)
    v_pages = quantized(v_plain, kind, g, scale_of=k_pages if d_v == 512 else None)
    q = torch.randn(sum(q_lens), h, d_qk, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    got = cpu_attention.paged_prefill_attention(q, k_pages.data, v_pages.data, cu, context_lens, table, scale, 0,
                                                k_pages.scale, v_pages.scale)
    assert_close(got, paged_prefill_attention_reference(q, k_pages, v_pages, cu, context_lens, table, scale), dtype)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("d_qk,d_v,h,h_kv", [(72, 72, 8, 2), (576, 512, 4, 1)])
def test_quantized_write_equals_reference_bitwise(kind, d_qk, d_v, h, h_kv):
    """Codes and int8 scales as the reference's quantization gives them (MLA: one scale for latent and rope)."""
    g = torch.Generator().manual_seed(8)
    plain_k, plain_v, _ = cache(d_qk, d_v, h_kv, [40, 40], torch.float32, g)
    ref_k = quantized(plain_k, kind, g)
    ref_v = quantized(plain_v, kind, g, scale_of=ref_k if d_v == 512 else None)
    got_k = attention.QuantizedPages(ref_k.data.clone(), ref_k.scale.clone())
    got_v = (attention.QuantizedPages(got_k.data[..., :512], got_k.scale) if d_v == 512
             else attention.QuantizedPages(ref_v.data.clone(), ref_v.scale.clone()))
    k = torch.randn(9, h_kv, d_qk, generator=g) * 3
    v = k[..., :d_v] if d_v == 512 else torch.randn(9, h_kv, d_v, generator=g)
    slots = torch.randperm(ref_k.shape[0] * PAGE, generator=g)[:9]
    slots[4] = -1
    write_kv_slots_reference(ref_k, ref_v, k, v, slots)
    cpu_attention.write_kv_slots(got_k.data, got_v.data, k, v, slots, got_k.scale, got_v.scale)
    for got, ref in ((got_k, ref_k), (got_v, ref_v)):
        assert torch.equal(got.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(got.scale, ref.scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h,h_kv", [(6, 2), (5, 5), (12, 4), (3, 1)])
def test_alibi_prefill_and_decode_match_reference(h, h_kv, dtype):
    """ALiBi (MPT's slopes, odd head counts) on the CPU path, through the public launchers, vs the references:
    prefill of whole prompts and chunks after a cached prefix, decode with a padding row; poisoned caches."""
    g = torch.Generator().manual_seed(2)
    slopes = attention.alibi_slopes(h)
    q_lens, ctx = zip(*PREFILL)
    k_pages, v_pages, table = cache(64, 64, h_kv, ctx, dtype, g)
    q = torch.randn(sum(q_lens), h, 64, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    ref = paged_prefill_attention_reference(q, k_pages, v_pages, cu, context_lens, table, 0.125, alibi_slopes=slopes)
    k_bad, v_bad, table_bad = poisoned(k_pages, v_pages, table, [(0, c) for c in ctx])
    got = paged_prefill_attention(q, k_bad, v_bad, cu, context_lens, table_bad, 0.125, alibi_slopes=slopes)
    assert_close(got, ref, dtype)

    k_pages, v_pages, table = cache(64, 64, h_kv, DECODE_LENS, dtype, g)
    q = torch.randn(len(DECODE_LENS), h, 64, generator=g).to(dtype)
    lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    ref = decode_attention_reference(q, k_pages, v_pages, lens, table, 0.125, alibi_slopes=slopes)
    k_bad, v_bad, table_bad = poisoned(k_pages, v_pages, table, [(0, n) for n in DECODE_LENS])
    got = decode_attention(q, k_bad, v_bad, lens, table_bad, 0.125, alibi_slopes=slopes)
    assert_close(got, ref, dtype)
    assert (got[DECODE_LENS.index(0)] == 0).all()
