"""Engine behaviour on a tiny Llama: prefix caching, chunked prefill, per-request seeded sampling,
requests that cannot fit, abort, and the add_request / step API. The reference for each option is
the same model without it (the token-level match with transformers is in test_engine_e2e.py)."""
from types import SimpleNamespace

import pytest
import torch
from models.test_llama import write_checkpoint
from tolerances import assert_greedy_equal, solo_runs, staggered_run

import tritonq
from tritonq.engine.engine import EngineDeadError
from tritonq.api.model import GenerationConfig


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, kv_heads=2, tied=False, bias=True, rope="llama3")
    return path


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def load(folder, **options):
    return tritonq.load(folder, max_seq_len=256, **{"max_num_seqs": 4, "max_num_batched_tokens": 64, **options})


def shared_prefix_prompts(n: int, prefix_len: int = 70) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 256, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(0, 256, (int(k),), generator=g).tolist()
            for k in torch.randint(1, 30, (n,), generator=g)]


def test_prefix_cached_prompts_give_the_uncached_logits(folder):
    prompts = shared_prefix_prompts(6)
    cached, plain = load(folder), load(folder, enable_prefix_caching=False)
    first = cached.generate(prompts[0], max_new_tokens=4, return_dict=True)  # fills the cache with the prefix
    assert first.token_ids == plain.generate(prompts[0], max_new_tokens=4, return_dict=True).token_ids
    bm = cached.engine.block_manager
    hits = bm.prefix_hits
    for prompt in prompts[1:]:  # every full block of the 70-token prefix (4 of 16) is read, not recomputed
        torch.testing.assert_close(cached.engine.prompt_logits(prompt), plain.engine.prompt_logits(prompt),
                                   atol=1e-5, rtol=0)
    assert bm.prefix_hits - hits == 4 * 16 * (len(prompts) - 1)
    got = cached.generate(prompts[1:], max_new_tokens=8, return_dict=True)
    want = plain.generate(prompts[1:], max_new_tokens=8, return_dict=True)
    assert_greedy_equal(plain, prompts[1:], got, want)  # cached rows come from other GEMM shapes
    assert plain.engine.block_manager.prefix_hits == 0


def test_chunked_prefill_gives_the_same_tokens(folder):
    prompts = shared_prefix_prompts(5, prefix_len=150)
    whole = load(folder, max_num_batched_tokens=1024, enable_prefix_caching=False)
    chunked = load(folder, max_num_batched_tokens=16, enable_prefix_caching=False)  # 150+ tokens: 10+ chunks
    a = whole.generate(prompts, max_new_tokens=6, return_dict=True)
    b = chunked.generate(prompts, max_new_tokens=6, return_dict=True)
    assert_greedy_equal(whole, prompts, b, a)


def test_seeded_request_samples_the_same_tokens_whatever_else_runs(folder, monkeypatch):
    """Exact equality of a sampled run beside others: the batch-invariant mode's promise, on the CPU kernels (without
    it bf16 rows can change with the batch, within their rounding, and flip a draw near a boundary)."""
    monkeypatch.delenv("TRITONQ_BACKEND")  # the mode's kernels, not the torch references
    model = load(folder, batch_invariant=True)
    engine = model.engine
    prompt = [5, 6, 7, 8]
    seeded = GenerationConfig(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=11)
    alone = model.generate(prompt, seeded, return_dict=True).token_ids[0]
    others = [GenerationConfig(max_new_tokens=n, temperature=t, seed=None) for n, t in ((3, 1.0), (12, 0.0), (7, 2.0))]
    ids = [engine.add_request([9, 9, 9], others[0]), engine.add_request(prompt, seeded),
           engine.add_request(list(range(40)), others[1]), engine.add_request([1], others[2])]
    tokens = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
    assert tokens[ids[1]] == alone
    assert len(set(model.generate(prompt, max_new_tokens=10, temperature=1.0, seed=s) for s in range(4))) > 1


def test_request_that_can_never_fit_names_the_numbers_and_one_that_fits_later_waits(folder):
    per_token = 2 * 2 * 2 * 16 * 4
    model = load(folder, kv_cache_gb=6 * 16 * per_token / 2 ** 30, max_num_seqs=4)  # 6 blocks = 96 tokens
    assert model.engine.block_manager.num_blocks == 6
    with pytest.raises(ValueError, match=r"prompt 1 has 90 tokens \+ max_new_tokens=10 = 100 tokens, "
                                         r"which need 7 KV blocks of 16, but the cache has 6 \(96 tokens\)"):
        model.generate([[1] * 10, [2] * 90], max_new_tokens=10)
    assert not model.engine.has_unfinished()  # refused before anything ran
    with pytest.raises(ValueError, match="max_seq_len=256"):
        model.generate([3] * 250, max_new_tokens=7)
    prompts = [[1] * 60, [2] * 60, [3] * 60]  # 5 blocks each with their tokens: one at a time
    out = model.generate(prompts, max_new_tokens=10, return_dict=True)
    assert_greedy_equal(model, prompts, out, solo_runs(model, prompts, max_new_tokens=10))


def test_abort_frees_blocks_and_max_new_tokens_zero_finishes_at_once(folder):
    model = load(folder)
    engine, bm = model.engine, model.engine.block_manager
    config = GenerationConfig(max_new_tokens=20)
    a, b = engine.add_request(list(range(50)), config), engine.add_request([4, 5], config)
    c = engine.add_request([6], GenerationConfig(max_new_tokens=0))
    first = engine.step()
    assert [(o.request_id, o.finished, o.token_id) for o in first if o.request_id == c] == [(c, True, None)]
    assert bm.num_free_blocks < bm.num_blocks
    engine.abort(a)
    engine.abort(12345)  # unknown: ignored
    seen = [o.request_id for _ in range(3) for o in engine.step()]
    assert a not in seen and b in seen
    engine.abort(b)
    assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_kv_cache_sized_from_the_budget_and_logged(folder, caplog):
    per_token = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x kv heads x head dim x fp32 bytes
    assert load(folder).engine.runner.model.kv_layout.bytes_per_token(torch.float32) == per_token
    # CPU default: what max_num_seqs=4 sequences of max_seq_len=256 (16 blocks each) use, far below 4 GiB
    assert load(folder).engine.block_manager.num_blocks == 4 * 16
    with caplog.at_level("INFO", logger="tritonq.engine.runner"):
        model = load(folder, kv_cache_gb=100 * 16 * per_token / 2 ** 30 + 1e-9)
    assert model.engine.block_manager.num_blocks == 100
    assert model.engine.runner.cache.k[0].shape == (100, 16, 2, 16)
    assert "KV cache: 100 blocks of 16 tokens = 1600 tokens" in caplog.text
    assert "6.2 sequences of max_seq_len=256 at once" in caplog.text
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        load(folder, kv_cache_gb=1e-9)


def test_prefix_hit_and_chunks_through_the_triton_kernels_match_the_torch_references(tmp_path, monkeypatch):
    """The interpreter runs the paged-context prefill kernel with queries that start past cached pages (a
    prefix hit, then 16-token chunks) and the paged decode kernel; the torch references, without prefix
    caching and in one chunk, give the same tokens and log-probabilities."""
    write_checkpoint(tmp_path, kv_heads=2, tied=True, bias=True, rope="llama3", hidden=32)
    prompts = shared_prefix_prompts(3, prefix_len=35)  # 2 full blocks shared
    options = {"max_seq_len": 64, "max_num_seqs": 2}
    monkeypatch.setenv("TRITONQ_BACKEND", "triton")
    kernels = tritonq.load(tmp_path, max_num_batched_tokens=16, **options)
    first = kernels.generate(prompts[0], max_new_tokens=3, return_dict=True)
    rest = kernels.generate(prompts[1:], max_new_tokens=3, return_dict=True)
    bm = kernels.engine.block_manager
    assert bm.prefix_hits == 2 * 32 and bm.num_free_blocks == bm.num_blocks
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    reference = tritonq.load(tmp_path, max_num_batched_tokens=64, enable_prefix_caching=False, **options)
    want = reference.generate(prompts, max_new_tokens=3, return_dict=True)
    assert first.token_ids + rest.token_ids == want.token_ids
    for got, expected in zip(first.logprobs + rest.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-4, rtol=0)


def test_mixed_steps_under_preemption_and_shared_prefixes_give_the_solo_greedy_runs(folder):
    """Prompts sharing a prefix arrive one per step into a cache too small for them all: steps mix running
    decodes with prefill chunks of new prompts, sequences are preempted and resumed, prefix blocks are
    shared; every request still gives its solo greedy run (a model without prefix caching, one prompt at a time)."""
    per_token = 2 * 2 * 2 * 16 * 4
    model = load(folder, kv_cache_gb=8 * 16 * per_token / 2 ** 30, max_num_batched_tokens=32)
    engine = model.engine
    assert engine.block_manager.num_blocks == 8
    # 32 shared tokens (2 blocks) + 16 of each prompt's own: a prompt holds 1 block of its own until its
    # first decode needs another, so 4 running prompts need 2 + 8 blocks and some are preempted
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 256, (32,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 256, (16 if i % 4 else 7,), generator=g).tolist() for i in range(8)]
    steps = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        step = schedule()
        if step is not None:  # (decoding sequences, prefill chunks) of the step
            decodes = sum(s.num_computed_tokens + n == s.num_tokens and n == 1
                          for s, n in zip(step.seqs, step.num_new_tokens))
            steps.append((decodes, len(step.seqs) - decodes))
        return step
    engine.scheduler.schedule = recording_schedule
    got = staggered_run(engine, prompts, GenerationConfig(max_new_tokens=12))
    assert any(decodes and chunks for decodes, chunks in steps), "no step mixed decodes with prefill chunks"
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
    plain = load(folder, enable_prefix_caching=False)
    assert_greedy_equal(plain, prompts, got, solo_runs(plain, prompts, max_new_tokens=12))


def test_grouped_decode_on_two_threads_gives_the_solo_greedy_runs(folder, monkeypatch):
    """The CPU backend's decode in padded groups of sequences (kernels/cpu/attention.py, several threads; forced
    here at this tiny size; the torch path, as where the C kernel is not built) gives every request its solo greedy
    run (one prompt alone decodes per sequence)."""
    from tritonq.kernels.cpu import attention as cpu_attention, native as cpu_native
    monkeypatch.delenv("TRITONQ_BACKEND")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the CPU backend, not the Triton kernels interpreted
    monkeypatch.setattr(cpu_native, "paged_attention", lambda *args, **kwargs: None)
    monkeypatch.setattr(cpu_attention, "GROUPED_WORK", 1)
    plan, groups = cpu_attention.key_plan, []
    monkeypatch.setattr(cpu_attention, "key_plan", lambda *a: groups.extend(plan(*a).groups) or plan(*a))
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in (5, 40, 41, 17, 90, 3)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load(folder, max_num_seqs=6, max_num_batched_tokens=256)
        got = model.generate(prompts, max_new_tokens=12, return_dict=True)
        assert any(group.index is not None for group in groups)  # decode steps ran padded groups
        plain = load(folder, enable_prefix_caching=False)
        monkeypatch.setattr(cpu_attention, "GROUPED_WORK", 1 << 60)
        assert_greedy_equal(plain, prompts, got, solo_runs(plain, prompts, max_new_tokens=12))
    finally:
        torch.set_num_threads(before)


def test_native_attention_on_two_threads_gives_the_solo_greedy_runs(folder, monkeypatch):
    """Prefill and decode through the C kernel (kernels/cpu/native.py) with its helper thread claiming work items
    beside the engine's thread: every request gets its solo greedy run on the torch path (one thread, per
    sequence)."""
    from tritonq.kernels.cpu import native as cpu_native
    monkeypatch.delenv("TRITONQ_BACKEND")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    native = cpu_native.paged_attention
    monkeypatch.setattr(cpu_native, "paged_attention", lambda *a: calls.append(native(*a)) or calls[-1])
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in (5, 40, 41, 17, 90, 3, 64, 9, 33)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = load(folder, max_num_seqs=9, max_num_batched_tokens=256).generate(prompts, max_new_tokens=12,
                                                                                return_dict=True)
    finally:
        torch.set_num_threads(before)
    assert calls and all(out is not None for out in calls)  # every prefill and decode ran the C kernel
    assert any(out.shape[0] > 9 for out in calls)  # prefill chunks among them (a decode step has 9 rows at most)
    monkeypatch.setattr(cpu_native, "paged_attention", lambda *args, **kwargs: None)
    plain = load(folder, enable_prefix_caching=False)
    assert_greedy_equal(plain, prompts, got, solo_runs(plain, prompts, max_new_tokens=12))


# ---- failures: a step that raises, non-finite logits, a dead device ------------------------------------

def run_engine(engine, ids) -> dict[int, list]:
    """Step until nothing is unfinished; every RequestOutput by request id."""
    outputs = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def as_output(outs: list) -> SimpleNamespace:
    """A request's outputs as the fields assert_greedy_equal compares (a one-prompt GenerationOutput)."""
    return SimpleNamespace(token_ids=[[o.token_id for o in outs]], logprobs=[[o.logprob for o in outs]],
                           finish_reasons=[outs[-1].finish_reason])


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


def test_a_step_that_raises_fails_its_requests_only_and_the_engine_goes_on(folder, monkeypatch):
    """max_num_seqs=2: requests 0 and 1 run, 2 and 3 wait; the second step (their decode) raises, and a
    request arrives during it. 0 and 1 finish with "error" and the exception; the waiting ones and the
    late one then give their solo outputs, every block is freed and later requests are answered."""
    model = load(folder, max_num_seqs=2)
    engine, bm = model.engine, model.engine.block_manager
    config = GenerationConfig(max_new_tokens=5)
    solo = [model.generate(p, config, return_dict=True) for p in PROMPTS]
    ids = [engine.add_request(p, config) for p in PROMPTS]
    run, calls, late = engine.runner.run, [], []

    def failing(ctx):
        calls.append(ctx)
        if len(calls) == 2:
            late.append(engine.add_request(PROMPTS[0], config))  # sent while the step runs
            raise RuntimeError("injected failure")
        return run(ctx)
    monkeypatch.setattr(engine.runner, "run", failing)
    outputs = run_engine(engine, ids)
    for rid in ids[:2]:
        last = outputs[rid][-1]
        assert (last.finished, last.finish_reason, last.token_id) == (True, "error", None)
        assert last.error == "RuntimeError: injected failure" and last.request.error == last.error
        assert len(outputs[rid]) == 2  # its first token (the prefill), then the error
    for rid, want in zip(ids[2:] + late, solo[2:] + solo[:1]):
        assert_greedy_equal(model, [PROMPTS[solo.index(want)]], as_output(outputs[rid]), want)
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests
    monkeypatch.undo()
    assert model.generate(PROMPTS[1], config, return_dict=True).token_ids == solo[1].token_ids


def test_non_finite_logits_fail_that_request_only(folder, monkeypatch):
    """A decode step whose logits row of one request holds NaN (then another's holds one inf): that
    request ends with "error" and no token; the others in the step go on to their solo outputs."""
    model = load(folder, max_num_seqs=2)
    engine = model.engine
    config = GenerationConfig(max_new_tokens=5)
    solo = [model.generate(p, config, return_dict=True) for p in PROMPTS[:2]]
    for bad_row, value in ((1, float("nan")), (0, float("inf"))):
        ids = [engine.add_request(p, config) for p in PROMPTS[:2]]
        run, calls = engine.runner.run, []

        def poisoned(ctx, bad_row=bad_row, value=value, run=run, calls=calls):
            logits = run(ctx).clone()  # an inference tensor: a clone may be written
            calls.append(ctx)
            if len(calls) == 2:  # the first decode step: rows in admission order
                logits[bad_row, 7] = value
            return logits
        monkeypatch.setattr(engine.runner, "run", poisoned)
        outputs = run_engine(engine, ids)
        monkeypatch.undo()
        bad, good = outputs[ids[bad_row]], outputs[ids[1 - bad_row]]
        assert [o.token_id is None for o in bad] == [False, True] and bad[-1].finish_reason == "error"
        assert "non-finite logits" in bad[-1].error and "NaN/inf" in bad[-1].error
        assert_greedy_equal(model, [PROMPTS[1 - bad_row]], as_output(good), solo[1 - bad_row])
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_model_calls_raise_the_request_error(folder, monkeypatch):
    model = load(folder)
    monkeypatch.setattr(model.engine.runner, "run", lambda ctx: (_ for _ in ()).throw(ValueError("bad step")))
    with pytest.raises(RuntimeError, match="prompt 0 failed in the engine: ValueError: bad step"):
        model.generate(PROMPTS[0], max_new_tokens=3)
    stream = model.stream(PROMPTS[:2], max_new_tokens=3)
    with pytest.raises(RuntimeError, match="ValueError: bad step"):
        next(stream)
    assert not model.engine.has_unfinished()
    monkeypatch.undo()
    assert model.generate(PROMPTS[0], max_new_tokens=3) == load(folder).generate(PROMPTS[0], max_new_tokens=3)


def test_a_device_error_kills_the_engine_for_good(folder, monkeypatch):
    model = load(folder)
    engine = model.engine
    engine.add_request(PROMPTS[0], GenerationConfig(max_new_tokens=3))

    def device_error(ctx):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(engine.runner, "run", device_error)
    with pytest.raises(EngineDeadError, match="CUDA error: an illegal memory access") as info:
        engine.step()
    assert isinstance(info.value, RuntimeError)
    monkeypatch.undo()
    for call in (engine.step, lambda: engine.add_request([1], GenerationConfig()), lambda: engine.score([[1, 2]]),
                 lambda: model.generate("a", max_new_tokens=1)):
        with pytest.raises(EngineDeadError):
            call()
