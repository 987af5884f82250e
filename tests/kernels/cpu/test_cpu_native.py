"""The C attention kernel (kernels/cpu/csrc/attention.c through kernels/cpu/native.py) against the float32 torch
references, decode rows and prefill chunks; the build: cached per source and machine, and a missing or failing
compiler falls back to the torch path with one warning; its RMSNorm (after a residual addition or not), SwiGLU's
silu(g) * u, rope and KV write against the torch ops. (Its greedy-rows loop is tested with the sampler:
tests/engine/test_sampler.py.)

Cases: float32, bfloat16 and float16; head dims 32, 64 and 128 (the AVX-512 path where the CPU has it, a multiple of
16) and 80 (the generic loop, which every head dim takes elsewhere); MHA, GQA 4 and MQA; windows; page sizes 16 and
32; decode lengths 0 (zeros), 1, a page, a page + 1 and several pages; prefill chunks of 1, 3, 17 and 64 queries,
whole prompts and after a cached prefix, more queries than one work item's block; on 1, 2 and 3 threads. Everything
outside a query's keys is poisoned (NaN rows, -1 table entries) as in test_cpu_attention.py.
Tolerances (tests/tolerances.py "attention"): float32 the summation order; bf16 / fp16 the probabilities rounded
before the PV product (per key tile, against the running maximum: online softmax) and the output rounded once, as
the Triton kernels and the flash path.
"""
import logging
import platform
import subprocess
import sys
import threading

import pytest
import torch
import tolerances

from tritonq.kernels.cpu import attention as cpu_attention, native as cpu_native
from tritonq.kernels.norm_rope import rms_norm_reference
from tritonq.kernels.attention import decode_attention_reference, paged_cache, paged_prefill_attention_reference

TOL = tolerances.table("attention")
FEW = [0, 1, 17]  # fewer items than threads
MANY = [5, 16, 1, 33, 0, 100, 2, 47, 16, 64, 9, 31, 3, 80]
# prefill: (new tokens, context) per sequence; whole prompts, chunks after a cached prefix, a sequence without queries
PREFILL = [(1, 1), (3, 3), (17, 17), (64, 64), (1, 40), (6, 100), (17, 33), (0, 12), (40, 75)]


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def case(lens, d, h, h_kv, page, dtype, window, seed=0):
    """q, poisoned pages and table, lengths, and the reference over the clean pages."""
    g = torch.Generator().manual_seed(seed)
    S = max(max(lens), 1)
    k = torch.randn(len(lens), S, h_kv, d, generator=g).to(dtype)
    v = torch.randn(len(lens), S, h_kv, d, generator=g).to(dtype)
    k_pages, v_pages, table = paged_cache(k, v, page, num_pages=len(lens) * -(-S // page) + 3, generator=g)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    cache_lens = torch.tensor(lens, dtype=torch.int32)
    scale = 0.7 / d ** 0.5
    ref = decode_attention_reference(q, k_pages, v_pages, cache_lens, table, scale, window)
    k_bad, v_bad = torch.full_like(k_pages, float("nan")), torch.full_like(v_pages, float("nan"))
    table_bad = torch.full_like(table, -1)
    for b, n in enumerate(lens):
        first = max(0, n - window) if window else 0
        for t in range(first, n):
            page_id, row = int(table[b, t // page]), t % page
            k_bad[page_id, row], v_bad[page_id, row] = k_pages[page_id, row], v_pages[page_id, row]
        table_bad[b, first // page: -(-n // page)] = table[b, first // page: -(-n // page)]
    return q, k_bad, v_bad, cache_lens, table_bad, scale, ref


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("lens", [FEW, MANY], ids=["few", "many"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,h,h_kv,page,window", [(64, 8, 2, 16, 0), (128, 4, 4, 32, 0), (32, 4, 1, 16, 7),
                                                   (80, 6, 3, 16, 20)])
def test_matches_reference_reading_only_each_sequences_keys(threads, lens, dtype, d, h, h_kv, page, window):
    q, k_pages, v_pages, cache_lens, table, scale, ref = case(lens, d, h, h_kv, page, dtype, window)
    got = cpu_native.decode_attention(q, k_pages, v_pages, cache_lens, table, scale, window)
    assert got is not None, "the C kernel did not take a call of plain pages (is it built? see the log)"
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    for b, n in enumerate(lens):
        if n == 0:
            assert (got[b] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 70, 64, 3])
def test_long_sequences_and_windows_across_spans_of_64_keys(dtype, window):
    """The AVX-512 item updates a row's softmax once per span of 4 key tiles (64 keys): lengths around and past
    several spans, windows that start inside a span's later tiles and cross into the next span."""
    lens = [200, 130, 65, 64, 63, 129, 17]
    q, k_pages, v_pages, cache_lens, table, scale, ref = case(lens, 64, 8, 2, 16, dtype, window, seed=3)
    got = cpu_native.decode_attention(q, k_pages, v_pages, cache_lens, table, scale, window)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def prefill_case(chunks, d, h, h_kv, page, dtype, window, seed=0):
    """Packed q of the chunks (new tokens, context), poisoned pages and table, cu_seqlens, contexts, and the
    reference over the clean pages."""
    g = torch.Generator().manual_seed(seed)
    q_lens, contexts = zip(*chunks)
    S = max(contexts)
    k = torch.randn(len(chunks), S, h_kv, d, generator=g).to(dtype)
    v = torch.randn(len(chunks), S, h_kv, d, generator=g).to(dtype)
    k_pages, v_pages, table = paged_cache(k, v, page, num_pages=len(chunks) * -(-S // page) + 3, generator=g)
    q = torch.randn(sum(q_lens), h, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor(contexts, dtype=torch.int32)
    scale = 0.7 / d ** 0.5
    ref = paged_prefill_attention_reference(q, k_pages, v_pages, cu, context_lens, table, scale, window)
    k_bad, v_bad = torch.full_like(k_pages, float("nan")), torch.full_like(v_pages, float("nan"))
    table_bad = torch.full_like(table, -1)
    for b, (n_q, ctx) in enumerate(chunks):
        if not n_q:
            continue
        first = max(0, ctx - n_q - window + 1) if window else 0  # the first key the earliest query sees
        for t in range(first, ctx):
            page_id, row = int(table[b, t // page]), t % page
            k_bad[page_id, row], v_bad[page_id, row] = k_pages[page_id, row], v_pages[page_id, row]
        table_bad[b, first // page: -(-ctx // page)] = table[b, first // page: -(-ctx // page)]
    return q, k_bad, v_bad, cu, context_lens, table_bad, scale, ref


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,h,h_kv,page,window", [(64, 8, 2, 16, 0), (128, 4, 4, 32, 0), (32, 4, 1, 16, 7),
                                                   (80, 6, 3, 16, 20), (32, 16, 2, 16, 0)])
def test_prefill_matches_reference_reading_only_visible_keys(threads, dtype, d, h, h_kv, page, window):
    """Packed chunks: whole prompts (causal), chunks after a cached prefix, windows, a sequence without queries;
    (32, 16, 2): GQA 8, one query per work item's block of 4 (QUERY_ROWS 32) -> 40 queries in 10 items."""
    q, k_pages, v_pages, cu, contexts, table, scale, ref = prefill_case(PREFILL, d, h, h_kv, page, dtype, window)
    got = cpu_native.paged_attention(q, k_pages, v_pages, cu, contexts, table, scale, window)
    assert got is not None, "the C kernel did not take a call of plain pages (is it built? see the log)"
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="-mno-avx512f is an x86 flag")
def test_the_build_without_avx512_matches_the_reference_too(fresh_library, monkeypatch):
    """A CPU without AVX-512 (most AMD Zen 2/3, many desktops) gets the generic C items for every head dim: built here
    with -mno-avx512f, prefill and decode against the references."""
    monkeypatch.setattr(cpu_native, "FLAGS", [*cpu_native.FLAGS, "-mno-avx512f"])
    for d, dtype in [(64, torch.bfloat16), (32, torch.float32), (128, torch.float16)]:
        q, k_pages, v_pages, cu, contexts, table, scale, ref = prefill_case(PREFILL, d, 8, 2, 16, dtype, 0)
        got = cpu_native.paged_attention(q, k_pages, v_pages, cu, contexts, table, scale, 0)
        assert got is not None
        torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
        q, k_pages, v_pages, lens, table, scale, ref = case(MANY, d, 8, 2, 16, dtype, 5)
        got = cpu_native.decode_attention(q, k_pages, v_pages, lens, table, scale, 5)
        torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def int8_linear_case(K=160, N=200, group=32, M=5, seed=0):
    """x, the int8 linear's blocked weight and bias, and the fp32 reference x @ (codes * scale) + bias."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (K, N), dtype=torch.int8, generator=g)
    scales = (torch.rand(K // group, N, generator=g) / 64).half()
    bias, x = torch.randn(N, generator=g), torch.randn(M, K, generator=g)
    ref = x @ (codes.float() * scales.float().repeat_interleave(group, dim=0)) + bias
    return x, *cpu_native.int8_linear_weight(codes, scales), bias, ref


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="-mno-avx512f is an x86 flag")
def test_the_int8_linear_gives_the_same_bits_without_avx512_and_on_two_threads(fresh_library, monkeypatch):
    """The generic item (a CPU without AVX-512) makes each output the same chain in k order as the AVX-512 one:
    the same bits; so do two threads (items are whole column blocks). Both within fp32 rounding of the reference."""
    x, codes, scales, bias, ref = int8_linear_case()
    y = cpu_native.int8_linear(x, codes, scales, 200, bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_native.int8_linear(x, codes, scales, 200, bias, parallel=True), y)
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(cpu_native, "FLAGS", [*cpu_native.FLAGS, "-mno-avx512f"])
    cpu_native.library.cache_clear()
    assert torch.equal(cpu_native.int8_linear(x, codes, scales, 200, bias), y)


def test_a_process_that_ran_it_on_two_threads_exits_cleanly(tmp_path):
    """Calls on two threads leave nothing running at exit (an earlier design, threads of our own that could still be
    inside a call while the interpreter finalized, aborted about one run in two: "terminate called without an active
    exception"): the kernel's team is torch's OpenMP team, which returns with the call."""
    script = tmp_path / "run.py"
    script.write_text(
        "import torch\n"
        "from tritonq.kernels.cpu import native as cpu_native\n"
        "torch.set_num_threads(2)\n"
        "B, P = 256, 256 * 21 + 1\n"
        "lens = torch.randint(16, 320, (B,), dtype=torch.int32)\n"
        "table = (torch.randperm(P - 1) + 1)[:B * 21].view(B, 21).int()\n"
        "k, v = torch.randn(P, 16, 2, 32).bfloat16(), torch.randn(P, 16, 2, 32).bfloat16()\n"
        "q = torch.randn(B, 4, 32).bfloat16()\n"
        "for _ in range(30):\n"
        "    assert cpu_native.decode_attention(q, k, v, lens, table, 0.2, 0) is not None\n")
    for _ in range(4):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]


def test_repeated_calls_on_several_threads_stay_equal():
    """Items are claimed by whichever thread comes first: the result must not depend on who did which (each
    item is computed the same way whatever thread runs it), over many calls."""
    q, k_pages, v_pages, cache_lens, table, scale, _ = case(MANY, 64, 8, 2, 16, torch.bfloat16, 0, seed=4)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = cpu_native.decode_attention(q, k_pages, v_pages, cache_lens, table, scale, 0)
        for _ in range(50):
            assert torch.equal(cpu_native.decode_attention(q, k_pages, v_pages, cache_lens, table, scale, 0), first)
    finally:
        torch.set_num_threads(before)


def test_runs_on_torch_openmp_team_from_any_python_thread():
    """The team is torch's OpenMP runtime's (GOMP_parallel of the library torch's ops run on), found on this build;
    a call from another Python thread (the server's engine thread) gets its own team and matches the reference too."""
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        assert cpu_native.omp_parallel() is not None
    q, k_pages, v_pages, cache_lens, table, scale, ref = case(MANY, 64, 8, 2, 16, torch.bfloat16, 0, seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        here = cpu_native.decode_attention(q, k_pages, v_pages, cache_lens, table, scale, 0)
        there = []
        worker = threading.Thread(target=lambda: there.append(
            cpu_native.decode_attention(q, k_pages, v_pages, cache_lens, table, scale, 0)))
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(before)
    for got in (here, there[0]):  # bf16: probabilities and output rounded once each (tests/tolerances.py)
        torch.testing.assert_close(got.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


def test_calls_it_does_not_take_return_none_and_run_the_torch_path(monkeypatch):
    """8-bit pages, Dqk != Dv, pages that are not contiguous and page sizes that are not powers of two are the
    torch path's (cpu_attention.decode_attention falls back to it and still matches the reference)."""
    q, k_pages, v_pages, cache_lens, table, scale, ref = case([3, 17], 64, 4, 2, 16, torch.float32, 0)
    assert cpu_native.decode_attention(q, k_pages.to(torch.bfloat16), v_pages, cache_lens, table, scale, 0) is None
    assert cpu_native.decode_attention(q, k_pages, v_pages[..., :32], cache_lens, table, scale, 0) is None
    strided = torch.cat([k_pages, k_pages], -1)[..., :64]
    assert cpu_native.decode_attention(q, strided, v_pages, cache_lens, table, scale, 0) is None
    q24, k24, v24, lens24, table24, scale24, ref24 = case([3, 30], 64, 4, 2, 24, torch.float32, 0)
    assert cpu_native.decode_attention(q24, k24, v24, lens24, table24, scale24, 0) is None
    got = cpu_attention.decode_attention(q24, k24, v24, lens24, table24, scale24, 0)
    torch.testing.assert_close(got, ref24, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_builds_once_into_the_cache_folder_and_reuses_it(fresh_library, caplog):
    with caplog.at_level(logging.INFO, logger="tritonq.kernels.cpu.native"):
        assert cpu_native.library() is not None
    built = list((fresh_library / "native").glob("cpu_native-*.so"))
    assert len(built) == 1 and any(f"built {cpu_native.CSRC}" in r.getMessage() for r in caplog.records)
    cpu_native.library.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tritonq.kernels.cpu.native"):
        assert cpu_native.library() is not None  # another process: loads the cached build, no compiler run
    assert not caplog.records and list((fresh_library / "native").glob("*.so")) == built


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_without_a_working_compiler_decode_falls_back_with_one_warning(fresh_library, monkeypatch, caplog, compiler):
    if compiler == "missing":
        monkeypatch.setattr(cpu_native, "_compiler", lambda: None)
    else:  # `false` exits 1 without building anything
        monkeypatch.setenv("CC", "false")
    q, k_pages, v_pages, cache_lens, table, scale, ref = case(MANY, 64, 8, 2, 16, torch.float32, 0)
    with caplog.at_level(logging.WARNING, logger="tritonq.kernels.cpu.native"):
        for _ in range(2):
            got = cpu_attention.decode_attention(q, k_pages, v_pages, cache_lens, table, scale, 0)
            torch.testing.assert_close(got, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "torch's flash kernel" in warnings[0]
    assert ("no C compiler" if compiler == "missing" else "false exited with 1") in warnings[0]
    assert cpu_native.decode_attention(q, k_pages, v_pages, cache_lens, table, scale, 0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 64), (3, 7, 100), (17, 1000)])
def test_rms_norm_matches_the_torch_reference(dtype, shape):
    """The C RMSNorm against norm_rope.rms_norm_reference (upcast, torch's rms_norm, round, times the weight), rows
    contiguous and strided (a slice of wider rows). float32: the sum of squares in another order (1e-5); bf16 /
    fp16: the same two roundings, each possibly one ulp apart where the float32 statistics round differently
    (2 ulps: 2^-7 / 2^-10 relative)."""
    g = torch.Generator().manual_seed(sum(shape))
    wide = (torch.randn(*shape[:-1], shape[-1] + 5, generator=g) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    for x in (wide[..., :shape[-1]].contiguous(), wide[..., 2:shape[-1] + 2]):
        got = cpu_native.rms_norm(x, weight, 1e-6)
        assert got is not None and got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.float(), rms_norm_reference(x, weight, 1e-6).float(), atol=tol, rtol=tol)


def test_rms_norm_leaves_other_calls_to_the_reference():
    """A weight of another dtype than x (the reference promotes) and non-CPU-backend dtypes are not taken."""
    x = torch.randn(2, 8)
    assert cpu_native.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6) is None
    assert cpu_native.rms_norm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert cpu_native.rms_norm(x, torch.ones(8, 1), 1e-6) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 7, 100), (17, 1000)])
def test_add_rms_norm_is_the_addition_then_the_norm(monkeypatch, dtype, shape):
    """norm_rope.add_rms_norm on the CPU backend (the C loop, x a strided view as a residual never is but a caller
    may pass) against torch's addition and the torch reference (TRITONQ_BACKEND=torch): the sum is rounded as torch
    rounds it, so equal; the norm of it within the RMSNorm test's tolerance."""
    from tritonq.kernels.norm_rope import add_rms_norm
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape[:-1], shape[-1] + 3, generator=g) * 3).to(dtype)[..., 1:shape[-1] + 1]
    h = (torch.randn(shape, generator=g) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    calls = []
    run = cpu_native.rms_norm
    monkeypatch.setattr(cpu_native, "rms_norm", lambda *a, **k: calls.append(1) or run(*a, **k))
    total, normed = add_rms_norm(x, h, weight, 1e-6)
    assert calls == [1] and total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    _, want_normed = add_rms_norm(x, h, weight, 1e-6)
    assert torch.equal(total, x + h)  # elementwise: each sum rounded once to the dtype, on any CPU
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(normed.float(), rms_norm_reference(x + h, weight, 1e-6).float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="must match"):
        add_rms_norm(x, h[..., :-1], weight[:-1], 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 1), (3, 17), (17, 384), (64, 1000)])
def test_silu_mul_matches_the_torch_ops(monkeypatch, dtype, rows, inter):
    """layers.silu_mul on the CPU backend (the C loop) against F.silu(gate) * up (TRITONQ_BACKEND=torch) on a fused
    gate/up projection's output and on a strided view of one, values from -30 to 30 (silu's tails) plus NaN and
    infinities: the same two roundings over float32 silu, whose exp is within 2 ulp of torch's, so one ulp of the
    dtype apart at most; NaN where torch gives NaN."""
    from tritonq.formats.layers import silu_mul
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    g = torch.Generator().manual_seed(rows * inter)
    wide = (torch.rand(rows, 2 * inter + 4, generator=g) * 60 - 30).to(dtype)
    wide[0, 0], wide[-1, inter - 1], wide[0, inter] = float("nan"), float("inf"), float("-inf")
    calls = []
    run = cpu_native.silu_mul
    monkeypatch.setattr(cpu_native, "silu_mul", lambda *a: calls.append(1) or run(*a))
    for gate_up in (wide[:, :2 * inter].contiguous(), wide[:, 2:2 * inter + 2]):
        monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
        got = silu_mul(gate_up)
        monkeypatch.setenv("TRITONQ_BACKEND", "torch")
        want = silu_mul(gate_up)
        assert got.shape == want.shape == (rows, inter) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), equal_nan=True, rtol=torch.finfo(dtype).eps,
                                   atol=torch.finfo(dtype).eps * float(want.float().nan_to_num(0, 0, 0).abs().max()))
    assert calls == [1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,D", [(1, 6, 32), (3, 3, 64), (17, 5, 80), (64, 2, 128)])
def test_rope_matches_the_torch_ops_on_a_view_of_the_fused_projection(monkeypatch, dtype, T, H, D):
    """apply_rope on the CPU backend runs the C loop (cpu_native.rope) on the q/k heads of a fused qkv output (a
    strided view), as the models call it; against the torch ops (TRITONQ_BACKEND=torch) on the same inputs: the same
    roundings (x * cos to the dtype, then the sum), so at most one ulp of the dtype apart (the float32 sums may
    fuse a multiply-add differently)."""
    from tritonq.kernels.norm_rope import apply_rope
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    g = torch.Generator().manual_seed(T * D)
    qkv = torch.randn(1, T, H + 2, D, generator=g).to(dtype)
    x = qkv[:, :, :H]  # heads H + 2 apart: the v head is not rotated
    angles = torch.randn(1, T, D // 2, generator=g) * 5
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(dtype)
    calls = []
    run = cpu_native.rope
    monkeypatch.setattr(cpu_native, "rope", lambda *a: calls.append(1) or run(*a))
    got = apply_rope(x, cos, sin)
    assert calls == [1] and got.shape == x.shape and got.dtype == dtype
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    want = apply_rope(x, cos, sin)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps * float(want.float().abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_puts_each_token_in_its_slot_and_skips_padding(dtype):
    """cpu_attention.write_kv_slots on plain pages runs the C row copies: tokens land where index_copy_ puts them
    (shuffled slots, k a strided view of a fused projection as the models pass it), slots < 0 are skipped, and a
    slot past the pages raises before anything is written. Both only copy bytes, so the pages are compared exactly."""
    g = torch.Generator().manual_seed(7)
    P, page, h_kv, d = 6, 16, 2, 32
    k_pages = torch.randn(P, page, h_kv, d, generator=g).to(dtype)
    v_pages = torch.randn(P, page, h_kv, d, generator=g).to(dtype)
    T = 9
    fused = torch.randn(T, 3 * h_kv, d, generator=g).to(dtype)
    k, v = fused[:, h_kv:2 * h_kv], fused[:, 2 * h_kv:]  # rows contiguous, tokens 3 * h_kv * d apart
    slots = torch.randperm(P * page, generator=g)[:T]
    slots[[2, 5]] = -1
    want_k, want_v = k_pages.clone(), v_pages.clone()
    keep = slots >= 0
    want_k.view(-1, h_kv, d).index_copy_(0, slots[keep], k[keep])
    want_v.view(-1, h_kv, d).index_copy_(0, slots[keep], v[keep])
    calls = []
    run = cpu_native.write_kv
    try:
        cpu_native.write_kv = lambda *a: calls.append(1) or run(*a)
        cpu_attention.write_kv_slots(k_pages, v_pages, k, v, slots)
    finally:
        cpu_native.write_kv = run
    assert calls == [1]
    assert torch.equal(k_pages, want_k) and torch.equal(v_pages, want_v)
    bad = slots.clone()
    bad[-1] = P * page
    with pytest.raises(IndexError, match="past the 96 page rows"):
        cpu_native.write_kv(k_pages, v_pages, k + 1, v + 1, bad)
    assert torch.equal(k_pages, want_k) and torch.equal(v_pages, want_v)
