"""The batch-invariant mode (tritonq.load(batch_invariant=True), kernels.batch_invariant_mode; see
docs/batch_invariance.md).

Kernel level, CPU backend: for each op the mode changes, a row's output computed inside a batch of other rows is
bitwise the row computed alone (the mode's purpose is exact equality, so the comparison is exact), and the op still
computes what it should (against a float32 reference within its dtype's rounding). GPU launchers: the launch config
chosen in the mode is the same for every row count (no split-K), checked on the config choice itself (the numbers
need a GPU). Engine: the shipped model in bf16, 32 prompts alone, all at once and under preemption (a small KV
cache) give identical tokens, greedy and seeded.
"""
import pytest
import torch

import tritonq
from tritonq.demo import DEFAULT_MODEL
from tritonq.kernels import batch_invariant_mode, fp8_gemm, int4_gemm, int8_gemm
from tritonq.kernels.cpu import dense as cpu_dense, lowbit as cpu_lowbit, native as cpu_native
from tritonq.kernels.attention import configs as attention_configs
from tritonq.kernels.attention import paged_cache
from tritonq.kernels.dense_gemm import dense_gemm, dense_gemm_reference
from tritonq.formats.layers import Linear
from tritonq.quant.rtn import quantize_int4
from tritonq.quant.weights import DenseWeight

MS = [1, 3, 17, 64, 130]  # 130: above the int4 template's and the dequantize path's thresholds (8, 32)


@pytest.fixture(autouse=True)
def _cpu_backend(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    if cpu_native.library() is None:
        pytest.fail("the C kernels (kernels/cpu/csrc) did not build: the batch-invariant mode needs them")


def assert_rows_invariant(f, x: torch.Tensor) -> torch.Tensor:
    """f over the first M rows of x, for each M in MS, equals f over all of x on those rows, bit for bit, and each
    row alone equals its row in the batch; returns f(x)."""
    full = f(x)
    for M in MS:
        assert torch.equal(f(x[:M]), full[:M]), f"rows 0..{M - 1} computed as a batch of {M} differ"
        assert torch.equal(f(x[M - 1:M]), full[M - 1:M]), f"row {M - 1} alone differs"
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", [(72, 200), (300, 1040)])  # N off the 64-column blocks, K odd sizes
def test_dense_linear_rows_are_bitwise_independent_of_the_batch(dtype, N, K):
    g = torch.Generator().manual_seed(N + K)
    w = DenseWeight(torch.randn(N, K, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype))
    with batch_invariant_mode():
        assert cpu_dense.packs(w)
        packed = cpu_dense.pack(w)
    assert packed.onednn is None  # the mode keeps only the C loop's copy
    x = torch.randn(max(MS), K, generator=g).to(dtype)
    y = assert_rows_invariant(lambda rows: cpu_dense.linear(rows, packed, w.bias), x)
    # what it computes: x @ W^T + b summed in float32, rounded once to the dtype
    ref = x.double() @ w.weight.double().t() + w.bias.double()
    magnitude = x.double().abs() @ w.weight.double().abs().t() + w.bias.double().abs()
    unit = {torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert y.dtype == dtype
    assert ((y.double() - ref).abs() <= (unit + K * 2**-24) * magnitude).all()


def test_dense_linear_outside_the_mode_keeps_onednn():
    """The normal path is unchanged: a bf16 weight keeps its oneDNN form (where oneDNN runs bf16 natively)."""
    w = DenseWeight(torch.randn(300, 1040).bfloat16(), None)
    if cpu_dense.packs(w):
        assert cpu_dense.pack(w).onednn is not None


@pytest.mark.parametrize("options,K", [(dict(group_size=128, sym=False), 384), (dict(group_size=32, sym=True), 96),
                                       (dict(group_size=64, sym=True, act_order=True), 192)])
def test_int4_rows_are_bitwise_independent_of_the_batch(options, K):
    """4-bit weights: the eager kernel at every M (outside the mode 9+ rows take inductor's template, 33+ without
    it the dequantize path, each summing in another order)."""
    g = torch.Generator().manual_seed(K)
    w = quantize_int4(torch.randn(72, K, generator=g), **options)
    p = cpu_lowbit.prepare(w)
    x = torch.randn(max(MS), K, generator=g).bfloat16()
    with batch_invariant_mode():
        y = assert_rows_invariant(lambda rows: cpu_lowbit.linear(rows, p), x)
    ref = cpu_lowbit.linear(x[:8], p)  # 8 rows: the eager kernel in either mode
    assert torch.equal(y[:8], ref)


def test_dequantized_weight_rows_are_bitwise_independent_of_the_batch():
    """8-bit GPTQ (dequantized once to fp32): the C loop over an fp32 copy instead of MKL; the values within fp32
    rounding of MKL's."""
    g = torch.Generator().manual_seed(3)
    p = cpu_lowbit.prepare(quantize_int4(torch.randn(72, 192, generator=g), group_size=32, bits=8))
    assert isinstance(p, cpu_lowbit.CPUDenseWeight)
    x = torch.randn(max(MS), 192, generator=g)
    with batch_invariant_mode():
        y = assert_rows_invariant(lambda rows: cpu_lowbit.linear(rows, p), x)
    torch.testing.assert_close(y, cpu_lowbit.linear(x, p), rtol=1e-5, atol=1e-5 * y.abs().max().item())


def test_symmetric_int8_weight_rows_are_bitwise_independent_of_the_batch():
    """Symmetric 8-bit (GGUF Q8_0's form: int8 codes, the C int8 linear at every row count): each output one chain
    in k order, in and outside the mode."""
    g = torch.Generator().manual_seed(4)
    p = cpu_lowbit.prepare(quantize_int4(torch.randn(72, 192, generator=g), group_size=32, sym=True, bits=8))
    assert isinstance(p, cpu_lowbit.CPUInt8Weight)
    x = torch.randn(max(MS), 192, generator=g)
    with batch_invariant_mode():
        y = assert_rows_invariant(lambda rows: cpu_lowbit.linear(rows, p), x)
    assert torch.equal(y, cpu_lowbit.linear(x, p))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_gguf_weight_rows_are_bitwise_independent_of_the_batch(type_name):
    """GGUF block formats (GGUFWeight: the C GGUF linear at every row count, 4- and 8-row blocks): each output one
    chain in k order, in and outside the mode."""
    from formats.gguf_files import random_weight
    w, _ = random_weight(type_name, 72, 256, seed=5)
    p = cpu_lowbit.prepare(w)
    assert p is w
    x = torch.randn(max(MS), 256, generator=torch.Generator().manual_seed(5))
    with batch_invariant_mode():
        y = assert_rows_invariant(lambda rows: cpu_lowbit.linear(rows, p), x)
    assert torch.equal(y, cpu_lowbit.linear(x, p))


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("d", [64, 40])  # 64: the AVX-512 item (spans of 64 keys); 40: the generic one
def test_attention_row_is_the_same_in_decode_and_in_any_prefill_chunk(window, d):
    """A query's attention output is bitwise the same computed as a decode row, as a row of a whole prefill, or of a
    prefill chunk starting anywhere, beside another sequence: what chunked prefill, preemption (recomputed as
    prefill) and batching change. Holds outside the mode too (the kernel has one order per row)."""
    g = torch.Generator().manual_seed(d + window)
    L, other, H, H_kv = 150, 37, 4, 2
    k = torch.randn(2, L, H_kv, d, generator=g).bfloat16()
    v = torch.randn(2, L, H_kv, d, generator=g).bfloat16()
    k_pages, v_pages, table = paged_cache(k, v, 16, generator=g)
    q = torch.randn(L, H, d, generator=g).bfloat16()
    q_other = torch.randn(other, H, d, generator=g).bfloat16()
    scale = d ** -0.5

    def run(first: int, last: int) -> torch.Tensor:
        """Queries first .. last - 1 of sequence 0 (context last) beside all of sequence 1's `other` queries."""
        qs = torch.cat([q[first:last], q_other])
        cu = torch.tensor([0, last - first, last - first + other], dtype=torch.int32)
        lens = torch.tensor([last, other], dtype=torch.int32)
        out = cpu_native.paged_attention(qs, k_pages, v_pages, cu, lens, table, scale, window)
        assert out is not None
        return out[:last - first]

    whole = run(0, L)
    for first in (1, 5, 63, 64, 100, 149):
        assert torch.equal(run(first, L), whole[first:]), f"prefill chunk from {first}"
    for p in (0, 15, 63, 64, 65, 120, 149):
        assert torch.equal(run(p, p + 1), whole[p:p + 1]), f"decode row at position {p}"
    # and it is attention: against softmax(q k^T) v in float32 (bf16 probabilities and output: 2^-7 of the values)
    keys, values = k[0].float().repeat_interleave(H // H_kv, 1), v[0].float().repeat_interleave(H // H_kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
    pos = torch.arange(L)
    visible = (pos[None, :] <= pos[:, None]) & ((window == 0) | (pos[:, None] - pos[None, :] < max(window, 1)))
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)
    torch.testing.assert_close(whole.float(), ref, atol=2**-6, rtol=2**-6)


def test_gpu_gemm_configs_are_one_for_every_row_count_in_the_mode():
    """int4 / fp8 / int8 GEMMs and the MoE GEMMs: one config (no split-K) for every M in the mode; outside it decode
    rows take split-K tiles of 16 rows (so this test can tell the two apart)."""
    N, K = 4096, 4096
    choices = {
        "fp8": lambda M: fp8_gemm.tuned_config(M, N, K, weight_only=False),
        "int8": lambda M: int8_gemm.tuned_config(M, N, K),
        "int4": lambda M: int4_gemm.default_config(int4_gemm.config_rows(M), N, K),
    }
    for name, choose in choices.items():
        assert choose(1).SPLIT_K > 1 and choose(1) != choose(512), name
        with batch_invariant_mode():
            chosen = {choose(M) for M in (1, 3, 16, 17, 64, 100, 512, 4096)}
        assert len(chosen) == 1 and chosen.pop().SPLIT_K == 1, name


def test_gpu_decode_splits_do_not_follow_the_batch_in_the_mode():
    """Decode attention's splits: chosen for the batch outside the mode (fewer for more sequences), as for one
    sequence in it."""
    def splits(batch):
        return attention_configs.decode_config(batch, 8, 4096, 16, 128, 0, 128, sm_count=132).NUM_SPLITS
    assert splits(1) != splits(256)
    with batch_invariant_mode():
        assert {splits(b) for b in (1, 2, 7, 64, 256)} == {splits(1)}


PROMPTS = [f"Story {i}: " + "once upon a time " * (i % 5) + "there was a" + " very" * (i % 7) for i in range(32)]


@pytest.fixture(scope="module")
def bf16_model():
    with pytest.MonkeyPatch.context() as env:  # loaded for the CPU kernels (conftest sets the interpreter)
        env.delenv("TRITON_INTERPRET", raising=False)
        env.delenv("TRITONQ_BACKEND", raising=False)
        yield tritonq.load(DEFAULT_MODEL, dtype="bfloat16", batch_invariant=True, max_num_seqs=32, kv_cache_gb=0.05)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=7)])
def test_32_prompts_alone_all_at_once_and_under_preemption_give_identical_tokens(bf16_model, sampling):
    """64 tokens each: without the mode, 1 of these 32 greedy runs differs batched on the 2-core AVX-512 test box."""
    options = dict(max_new_tokens=64, ignore_eos=True, **sampling)
    alone = [bf16_model.generate(p, return_dict=True, **options).token_ids[0] for p in PROMPTS]
    together = bf16_model.generate(PROMPTS, return_dict=True, progress=False, **options).token_ids
    assert together == alone
    # a KV cache of 48 blocks of 16 tokens: 32 sequences of ~80-95 tokens preempt each other
    per_token = bf16_model.engine.runner.model.kv_layout.bytes_per_token(torch.bfloat16)
    small = tritonq.load(DEFAULT_MODEL, dtype="bfloat16", batch_invariant=True, max_num_seqs=32,
                         max_num_batched_tokens=64, kv_cache_gb=48 * 16 * per_token / 2**30)
    preempted = small.generate(PROMPTS, return_dict=True, progress=False, **options).token_ids
    assert small.engine.scheduler.num_preemptions > 0
    assert preempted == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_dense_gemm_matches_reference_and_rows_do_not_follow_the_batch(dtype, monkeypatch):
    """The mode's Triton dense GEMM (what dense linears run on CUDA in it; the interpreter here): x @ W^T + b within
    one rounding of the dtype at odd shapes, and a row alone equals its row in a batch (one config for every M)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(5)
    N, K = 72, 200
    w = DenseWeight(torch.randn(N, K, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype))
    x = torch.randn(70, K, generator=g).to(dtype)
    y = dense_gemm(x, w)
    ref = dense_gemm_reference(x, w)
    unit = {torch.float32: 2**-20, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]  # one rounding, 2 ulp
    torch.testing.assert_close(y.float(), ref.float(), rtol=unit, atol=unit * ref.abs().max().item())
    for M in (1, 3, 17, 64):
        assert torch.equal(dense_gemm(x[:M], w), y[:M]), M
    with batch_invariant_mode():  # Linear's dense GEMM in the mode is this kernel where Triton runs
        assert torch.equal(Linear(w)(x[:3]), y[:3])


def test_server_with_batch_invariant_gives_32_concurrent_requests_their_solo_tokens(bf16_model, tmp_path):
    """`tritonq serve --batch-invariant` in bf16 on the CPU kernels: 32 concurrent greedy completions of 64 tokens
    (through httpx, as the openai client sends them) equal each prompt generated alone in process."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import asyncio

    from serve_util import MODEL_NAME, Server

    # the CPU kernels, not the torch references that Server's environment selects
    entry = ["-c", "import os, runpy; os.environ.pop('TRITONQ_BACKEND', None); "
                   "runpy.run_module('tritonq.serve', run_name='__main__')"]
    server = Server(DEFAULT_MODEL, tmp_path / "server.log", "--dtype", "bfloat16", "--batch-invariant",
                    "--max-num-seqs", "32", entry=entry)
    try:
        async def complete(client, prompt):
            r = await client.post(f"{server.url}/v1/completions", json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        async def run():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*[complete(client, p) for p in PROMPTS])
        texts = asyncio.run(run())
    finally:
        server.stop()
    alone = [bf16_model.generate(p, max_new_tokens=64, ignore_eos=True) for p in PROMPTS]
    assert texts == alone


def test_bad_batch_invariant_options_are_refused_before_loading():
    from tritonq.config import EngineConfig
    with pytest.raises(ValueError, match="batch_invariant=1; expected True or False"):
        EngineConfig(batch_invariant=1)
    with pytest.raises(ValueError, match="compile=True"):
        EngineConfig(batch_invariant=True, compile=True)


def test_cli_load_options_pass_batch_invariant(monkeypatch):
    """--batch-invariant on a command that loads a model reaches tritonq.load (off without it)."""
    from tritonq import cli
    seen = []
    monkeypatch.setattr(tritonq, "load", lambda path, config, **options: seen.append(config.batch_invariant))
    for argv in (["m", "hi", "--batch-invariant"], ["m", "hi"]):
        parser = cli.generate_parser()
        cli.load_model(parser, parser.parse_args(argv))
    assert seen == [True, False]
