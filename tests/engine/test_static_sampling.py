"""#51: a static decode step samples inside the step (Sampler.static_step -> StaticSampling -> sample_rows,
runner.run_sampled, DecodeGraphs.replay_sampler).

CPU: the static sampling buffers over a padded bucket give the tokens, log-probabilities and top alternatives of
the eager sampler over the real rows, exactly (the same function over the same logits: padding rows and stages
a step does not use must change nothing), for each kind of setting alone and mixed in one batch, over three steps
(penalty counts carry over); rows the static step cannot hold fall back; an engine with static decode on gives
every prompt its solo run's tokens and log-probabilities (batch-invariant mode: exact).
GPU (`pytest -m gpu`): the sampler graph replayed after the model's graph equals the eager static step.
"""
import math
from types import SimpleNamespace

import pytest
import torch
from models.test_llama import write_checkpoint

import tritonq
from tritonq.api.model import GenerationConfig
from tritonq.engine.sampler import Sampler, SamplingParams, read_rows, sample_rows
from tritonq.engine.scheduler import StepKind

pytestmark = pytest.mark.usefixtures("one_thread")
V, EOS = 40, {3}
CONFIGS = {
    "greedy": GenerationConfig(),
    "temperature": GenerationConfig(temperature=0.9, seed=1),
    "top_k": GenerationConfig(temperature=1.2, top_k=5, seed=2),
    "top_p": GenerationConfig(temperature=1.0, top_p=0.6, seed=3),
    "min_p": GenerationConfig(temperature=1.5, min_p=0.2, seed=4),
    "penalties": GenerationConfig(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.7),
    "sampled_penalties": GenerationConfig(temperature=0.8, repetition_penalty=0.7, frequency_penalty=1.1, seed=5),
    "logit_bias": GenerationConfig(logit_bias={7: 5.0, 8: -2.5}),
    "min_tokens": GenerationConfig(min_tokens=5, stop_token_ids=(11, 12), temperature=0.7, seed=6),
    "top_logprobs": GenerationConfig(top_logprobs=4),
    "sampled_top_logprobs": GenerationConfig(temperature=1.0, top_k=8, top_logprobs=6, seed=7),
}
MIXED = ["greedy", "top_p", "penalties", "logit_bias", "min_tokens", "sampled_top_logprobs", "min_p"]


class Seq(SimpleNamespace):
    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt


def decode_step(names: list[str], prompts: list[list[int]]):
    """A decode ScheduledStep-like record over one sequence per config name (the fields step_rows reads)."""
    seqs = []
    for name, prompt in zip(names, prompts):
        config = CONFIGS[name]
        request = SimpleNamespace(config=config, sampling=SamplingParams(config, num_prompt_tokens=len(prompt)),
                                  grammar=None)
        seqs.append(Seq(token_ids=list(prompt), num_prompt=len(prompt), extra=request))
    return SimpleNamespace(kind=StepKind.DECODE, seqs=seqs, proposals=None)


def run_both(names: list[str], bucket: int, steps: int = 3, seed: int = 0):
    """`steps` decode steps of one sequence per name: the static path (bucket rows, the rest padding, random
    logits there too) and the eager sampler on the same real rows' logits must agree exactly at every step."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in torch.randint(1, 6, (len(names),), generator=g)]
    step = decode_step(names, prompts)
    static_sampler, eager_sampler = Sampler(), Sampler()
    for _ in range(steps):
        logits = torch.randn(bucket, V, generator=g) * 3
        logits[:len(names), 7] += 2.0  # near the biased token: a bias that matters
        sample = static_sampler.static_step(step, [1] * len(names), EOS, capacity=8, bucket=bucket, vocab=V,
                                            device=torch.device("cpu"))
        assert sample is not None, names
        got = read_rows(sample_rows(logits, sample.tensors, sample.top), sample.params, sample.top)
        want = eager_sampler.sample_step(logits[:len(names)].clone(), step, [1] * len(names), EOS)
        assert got == want, names
        assert all(t is not None for t in got[0])
        for seq, t in zip(step.seqs, got[0]):
            seq.token_ids.append(t)
    return step


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("bucket_of", [(1, 1), (3, 4), (2, 8)])
def test_static_sampling_equals_the_eager_sampler(name, bucket_of):
    rows, bucket = bucket_of
    run_both([name] * rows, bucket)


@pytest.mark.parametrize("bucket", [7, 8])
def test_a_mixed_batch_with_padding_equals_the_eager_sampler(bucket):
    run_both(MIXED, bucket, steps=4, seed=1)


def test_min_tokens_bans_eos_and_stop_ids_inside_the_step():
    """Logits that favour EOS and the stop ids: the static step never samples them below min_tokens, then can."""
    step = decode_step(["min_tokens", "min_tokens"], [[1, 2], [4]])
    sampler = Sampler()
    logits = torch.zeros(2, V)
    logits[:, [3, 11, 12]] = 50.0
    sample = sampler.static_step(step, [1, 1], EOS, capacity=8, bucket=2, vocab=V, device=torch.device("cpu"))
    tokens = read_rows(sample_rows(logits, sample.tensors, sample.top), sample.params, sample.top)[0]
    assert not set(tokens) & {3, 11, 12}
    for seq in step.seqs:
        seq.token_ids += [0] * 5
    sample = sampler.static_step(step, [1, 1], EOS, capacity=8, bucket=2, vocab=V, device=torch.device("cpu"))
    tokens = read_rows(sample_rows(logits, sample.tensors, sample.top), sample.params, sample.top)[0]
    assert set(tokens) <= {3, 11, 12}


def test_non_finite_rows_come_back_without_a_token():
    step = decode_step(["greedy", "temperature"], [[1], [2]])
    logits = torch.randn(4, V)
    logits[1, 5] = float("nan")
    sample = Sampler().static_step(step, [1, 1], EOS, capacity=8, bucket=4, vocab=V, device=torch.device("cpu"))
    tokens, logprobs, _ = read_rows(sample_rows(logits, sample.tensors, sample.top), sample.params, sample.top)
    assert tokens[1] is None and logprobs[1] is None and tokens[0] == int(logits[0].argmax())


def test_rows_the_static_step_cannot_hold_fall_back():
    """A grammar row (its bitmask is filled on the host per step), more bias entries than the buffers hold, and
    tensor parallel: static_step returns None, and the step samples eagerly over its logits."""
    step = decode_step(["greedy", "greedy"], [[1], [2]])
    step.seqs[1].extra.grammar = object()
    assert Sampler().static_step(step, [1, 1], EOS, capacity=8, bucket=2, vocab=V, device=torch.device("cpu")) is None
    big = GenerationConfig(logit_bias={i: 0.5 for i in range(V)})
    step = decode_step(["greedy"], [[1]])
    step.seqs[0].extra.sampling = SamplingParams(big)
    sampler = Sampler()
    sampler.MAX_BIAS_PER_ROW = 4  # 4 x capacity 8 = 32 < 40 entries
    assert sampler.static_step(step, [1], EOS, capacity=8, bucket=1, vocab=V, device=torch.device("cpu")) is None
    sampler.MAX_BIAS_PER_ROW = 5
    assert sampler.static_step(step, [1], EOS, capacity=8, bucket=1, vocab=V, device=torch.device("cpu")) is not None
    assert Sampler(world=2).static_step(decode_step(["greedy"], [[1]]), [1], EOS, capacity=8, bucket=1, vocab=V,
                                        device=torch.device("cpu")) is None


def test_static_buffers_keep_their_storage():
    """A graph holds the buffers' addresses: every step of a bucket hands the same tensors to sample_rows."""
    sampler = Sampler()
    first = None
    for names in (["top_p", "penalties", "logit_bias"], ["min_p", "sampled_penalties", "min_tokens"]):
        sample = sampler.static_step(decode_step(names, [[1], [2, 3], [4]]), [1] * 3, EOS, capacity=8, bucket=4,
                                     vocab=V, device=torch.device("cpu"))
        t = sample.tensors
        ptrs = [x.data_ptr() for x in (t.temperature, t.top_p, t.min_p, t.seeds, t.steps, t.top_k, t.seen, t.counts,
                                        t.repetition_penalty, *t.bias)]
        assert first is None or ptrs == first
        first = ptrs


# ---------------------------------------------------------------------------------------------------
# engine: static decode on, every prompt equals its solo run
# ---------------------------------------------------------------------------------------------------

ENGINE_CONFIGS = [GenerationConfig(max_new_tokens=9), GenerationConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3),
                  GenerationConfig(max_new_tokens=7, temperature=0.8, top_k=20, min_p=0.05, seed=4, top_logprobs=3),
                  GenerationConfig(max_new_tokens=10, repetition_penalty=1.3, frequency_penalty=0.4,
                                   logit_bias={5: 2.0}, min_tokens=6)]
ENGINE_PROMPTS = [[5, 6, 7, 8], [9, 9, 9], list(range(20, 40)), [1]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_checkpoint(path, kv_heads=2, tied=False, bias=True, rope="llama3")
    return path


def test_engine_with_static_decode_gives_every_prompt_its_solo_run(folder, monkeypatch):
    """Batch-invariant mode (the CPU kernels; exact): four requests of mixed sampling settings, decoded together in
    static buckets with sampling inside the step, give each request the tokens, log-probabilities and top
    alternatives it gets alone on an engine without static decode (log-probabilities within float32 rounding)."""
    monkeypatch.delenv("TRITONQ_BACKEND", raising=False)
    options = dict(max_seq_len=64, max_num_seqs=4, max_num_batched_tokens=64, batch_invariant=True)
    static = tritonq.load(folder, **options)
    static.engine.runner.use_static_decode(4)
    calls = []
    run_sampled = static.engine.runner.run_sampled
    monkeypatch.setattr(static.engine.runner, "run_sampled", lambda ctx, s: calls.append(len(s.params)) or
                        run_sampled(ctx, s))
    engine = static.engine
    ids = [engine.add_request(p, c) for p, c in zip(ENGINE_PROMPTS, ENGINE_CONFIGS)]
    got = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            if out.token_id is not None:
                got[out.request_id].append((out.token_id, out.logprob, out.top_logprobs))
    assert 4 in calls and 1 in calls  # static steps of 4 and of a lone last request (buckets 4 and 1) ran
    plain = tritonq.load(folder, **options)
    assert plain.engine.runner.static is None
    for rid, prompt, config in zip(ids, ENGINE_PROMPTS, ENGINE_CONFIGS):
        alone = plain.generate(prompt, config, return_dict=True)
        want = list(zip(alone.token_ids[0], alone.logprobs[0],
                        alone.top_logprobs[0] if config.top_logprobs else [None] * len(alone.token_ids[0])))
        # tokens and top alternatives exact; a log-probability within float32 rounding, since a lone greedy row
        # is sampled by the eager sampler's C loop (float64 normalizer) where the batch's rows are not
        assert [(t, top) for t, _, top in got[rid]] == [(t, top) for t, _, top in want], config
        assert [lp for _, lp, _ in got[rid]] == pytest.approx([lp for _, lp, _ in want], abs=1e-6, rel=0)
        assert all(math.isfinite(lp) for _, lp, _ in want)


def test_static_verification_steps_sample_inside_the_step_as_plain_decoding(monkeypatch):
    """Speculative decoding (n-gram, 3 proposals) with static verification steps (k + 1 = 4 rows a sequence,
    padded buckets) sampling inside the step: greedy, seeded top-k and top-N rows emit the tokens of plain decoding
    without speculation (the verification draws each position's token as a plain step at that length does)."""
    from engine.test_speculative import ENGINE, repetitive_prompts

    from tritonq.demo import DEFAULT_MODEL
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    prompts = repetitive_prompts(3, seed=2)
    configs = [GenerationConfig(max_new_tokens=16, ignore_eos=True),
               GenerationConfig(max_new_tokens=16, temperature=0.8, top_k=20, seed=11, ignore_eos=True),
               GenerationConfig(max_new_tokens=16, top_logprobs=2, logit_bias={13: 1.5}, ignore_eos=True)]
    spec = tritonq.load(DEFAULT_MODEL, speculative={"method": "ngram", "num_tokens": 3}, **ENGINE)
    runner = spec.engine.runner
    runner.use_static_decode(4, verify_tokens=4)
    verified = []
    run_sampled = runner.run_sampled
    monkeypatch.setattr(runner, "run_sampled", lambda ctx, s: verified.append(ctx.is_prefill) or run_sampled(ctx, s))
    engine = spec.engine
    got = {}
    for prompt, config in zip(prompts, configs):  # alone: every verification step holds k proposals more often
        got[prompt_id := engine.add_request(prompt, config)] = []
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None
                if out.token_id is not None:
                    got[prompt_id].append((out.token_id, out.top_logprobs))
    ids = list(got)
    assert verified.count(True) >= 3, verified.count(True)  # static verification steps sampled inside the step
    assert spec.engine.speculation.accepted > 0
    plain = tritonq.load(DEFAULT_MODEL, **ENGINE)
    for rid, prompt, config in zip(ids, prompts, configs):
        alone = plain.generate(prompt, config, return_dict=True)
        tops = alone.top_logprobs[0] if config.top_logprobs else [None] * len(alone.token_ids[0])
        assert [t for t, _ in got[rid]] == alone.token_ids[0], config
        for (_, top), want in zip(got[rid], tops):  # the same alternatives, log-probabilities within fp32 rounding
            assert (top is None) == (want is None) and (top is None or list(top) == list(want) and
                                                        list(top.values()) == pytest.approx(list(want.values()), abs=1e-5))


def test_sampler_graphs_are_captured_once_per_bucket_and_key_and_replayed(monkeypatch):
    """DecodeGraphs.replay_sampler with torch.cuda's graph calls faked (CPU): the first use of (bucket, key) runs the
    sampling twice (a warm-up, then the capture over the bucket's static logits, in the model graphs' pool) and
    replays it; a later use only replays and returns the same static output; another key or bucket captures its
    own graph."""
    import contextlib

    from tritonq.engine.cuda_graphs import DecodeGraphs, StaticDecodeInputs
    events = []

    class Graph:
        def replay(self):
            events.append("replay")
    stream = SimpleNamespace(wait_stream=lambda other: None)
    pools = []
    for name, value in dict(graph_pool_handle=lambda: "pool", Stream=lambda device: stream,
                            current_stream=lambda device=None: stream, stream=lambda s: contextlib.nullcontext(),
                            CUDAGraph=Graph, synchronize=lambda device=None: None,
                            graph=lambda g, pool=None, stream=None: pools.append(pool) or contextlib.nullcontext(),
                            empty_cache=lambda: None).items():
        monkeypatch.setattr(torch.cuda, name, value)
    graphs = DecodeGraphs(lambda ctx: torch.full((ctx.input_ids.shape[0], 5), 1.0), StaticDecodeInputs(4, 32, 16,
                          torch.device("cpu")), [1, 2, 4])
    graphs.capture()
    events.clear()

    def sample(logits):
        events.append(f"sample {logits.shape[0]}")
        return logits.sum(-1)
    out = graphs.replay_sampler(2, ("k",), sample)
    assert events == ["sample 2", "sample 2", "replay"] and out.tolist() == [5.0, 5.0] and pools[-1] == "pool"
    events.clear()
    assert graphs.replay_sampler(2, ("k",), sample) is out and events == ["replay"]
    events.clear()
    graphs.replay_sampler(2, ("other",), sample)
    graphs.replay_sampler(4, ("k",), sample)
    assert events == ["sample 2", "sample 2", "replay", "sample 4", "sample 4", "replay"]
    assert sorted(graphs.samplers) == [(2, ("k",)), (2, ("other",)), (4, ("k",))]


# ---------------------------------------------------------------------------------------------------
# GPU: the sampler graph replays the eager static step
# ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_sampler_graph_replay_equals_the_eager_static_step(folder):
    """load() on CUDA captures the decode graphs; generate() with sampling inside the graphs (model graph + sampler
    graph per bucket and stages) gives the tokens, log-probabilities and top alternatives of the same static steps
    run eagerly (replay_graphs False: the same functions without graphs)."""
    model = tritonq.load(folder, device="cuda", dtype=torch.float16, max_seq_len=128, max_num_seqs=4, kv_cache_gb=0.05)
    runner = model.engine.runner
    assert runner.graphs is not None
    configs = [GenerationConfig(max_new_tokens=12, **c) for c in (
        {}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}, {"repetition_penalty": 1.3, "logit_bias": {5: 2.0}},
        {"temperature": 0.7, "top_k": 10, "min_p": 0.1, "seed": 4, "top_logprobs": 3, "min_tokens": 4})]
    prompts = [[5, 17, 3], [12, 7, 33, 2, 9], [4], [8, 8, 8, 8, 8, 8, 8]]

    def run():
        engine = model.engine
        ids = [engine.add_request(p, c) for p, c in zip(prompts, configs)]
        out = {rid: [] for rid in ids}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].append((o.token_id, o.logprob, o.top_logprobs))
        return [out[rid] for rid in ids]
    graphed = run()
    assert runner.graphs.samplers  # sampler graphs were captured and replayed
    runner.replay_graphs = False
    eager = run()
    assert graphed == eager
