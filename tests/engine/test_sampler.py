"""The batched sampler against plain references written here (OpenAI / vLLM semantics): min_p, the
min_tokens mask of EOS and stop_token_ids, logit_bias, repetition / presence / frequency penalties,
top-N logprobs; a batch of mixed settings against each row alone; and min_tokens / ignore_eos /
stop_token_ids / tiny temperatures end to end on a tiny Llama (the reference: the same model's greedy run)."""
import math
from collections import Counter

import pytest
import torch

from tritonq.engine.sampler import (SamplingParams, SamplingTensors, argmax_rows, finite_rows, open_unit_uniform,
                                   process_logits, row_settings, sample_logits, sampling_noise)
from tritonq.api.model import GenerationConfig

N = 4000  # draws per distribution: frequencies within 0.03 of the probabilities


def reference_min_p(logits: torch.Tensor, temperature: float, min_p: float, top_k: int = 0) -> torch.Tensor:
    """The distribution min_p leaves, the way vLLM defines it: softmax(logits / T), tokens with
    p < min_p * max p dropped, then top-k over what is left, renormalized."""
    probs = torch.softmax(logits / temperature, -1)
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    if top_k:
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
    return probs / probs.sum()


def frequencies(logits, temperature, min_p, top_k=0):
    rows = logits.repeat(N, 1)
    seeds = torch.stack([torch.arange(N), torch.zeros(N, dtype=torch.int64)])
    noise = sampling_noise(seeds, torch.zeros(N, dtype=torch.int64), logits.shape[-1])
    tokens = sample_logits(rows, SamplingTensors(temperature=torch.full((N,), temperature),
                                                 top_k=torch.full((N,), top_k), top_p=torch.ones(N), noise=noise,
                                                 filters=top_k > 0, min_p=torch.full((N,), min_p)))
    return torch.bincount(tokens, minlength=logits.shape[-1]).float() / N


@pytest.mark.parametrize("temperature, min_p, top_k", [(1.0, 0.1, 0), (0.7, 0.3, 0), (2.0, 0.05, 3), (1.0, 0.0, 0),
                                                       (1.0, 1.0, 0)])
def test_min_p_samples_the_reference_distribution(temperature, min_p, top_k):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -3.0, 2.9])
    want = reference_min_p(logits, temperature, min_p, top_k)
    got = frequencies(logits, temperature, min_p, top_k)
    assert (got - want).abs().max() < 0.03
    assert (got[want == 0] == 0).all()  # a dropped token is never drawn


def test_min_p_is_per_row_and_greedy_rows_stay_argmax():
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [5.0, 0.0, 4.9]])
    noise = sampling_noise(torch.tensor([[1, 2, 3], [0, 0, 0]]), torch.zeros(3, dtype=torch.int64), 3)
    noise[:2] = torch.tensor([100.0, 0.0, 0.0])  # rows 0, 1 pick token 0 if min_p keeps it
    tokens = sample_logits(logits, SamplingTensors(temperature=torch.tensor([1.0, 1.0, 0.0]),
                                                   top_k=torch.zeros(3, dtype=torch.int64), top_p=torch.ones(3),
                                                   noise=noise, min_p=torch.tensor([0.5, 0.0, 0.9])))
    assert tokens.tolist() == [2, 0, 0]  # row 0: p0 / pmax = e^-2 < 0.5, dropped; row 1: kept; row 2: argmax


@pytest.fixture(scope="module")
def model(tiny_llama_model):
    return tiny_llama_model


V = 12
EOS = {3}


def reference_logits(logits: list[float], prompt: list[int], generated: list[int], config: GenerationConfig,
                     below_min_tokens: bool) -> list[float]:
    """What a row samples from before temperature, one token at a time in plain Python: EOS and
    stop_token_ids at -inf below min_tokens, + logit_bias, the CTRL repetition penalty over prompt and
    generated tokens, then OpenAI's  logit - count * frequency_penalty - (count > 0) * presence_penalty
    with counts over the generated tokens only."""
    x = list(logits)
    if below_min_tokens:
        for t in EOS | set(config.stop_token_ids):
            x[t] = -math.inf
    for t, bias in dict(config.logit_bias).items():
        x[t] += bias
    for t in set(prompt) | set(generated):
        x[t] = x[t] / config.repetition_penalty if x[t] > 0 else x[t] * config.repetition_penalty
    for t, count in Counter(generated).items():
        x[t] -= count * config.frequency_penalty + config.presence_penalty
    return x


def reference_log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    total = math.log(sum(math.exp(v - top) for v in logits))
    return [v - top - total for v in logits]


MIXED = [  # greedy rows: each one's token is the argmax of its processed logits
    GenerationConfig(),
    GenerationConfig(logit_bias={5: 100.0, 0: -100.0, 7: 2.5}, top_logprobs=3),
    GenerationConfig(presence_penalty=1.5, frequency_penalty=0.75, top_logprobs=20),
    GenerationConfig(presence_penalty=-2.0, frequency_penalty=-0.5, repetition_penalty=1.3),
    GenerationConfig(frequency_penalty=2.0, logit_bias={9: -3.0}, min_tokens=4, stop_token_ids=(1, 8)),
    GenerationConfig(repetition_penalty=0.8, presence_penalty=0.5, min_tokens=4, top_logprobs=1),
]
PROMPTS = [[1, 2], [4, 4, 6], [2, 9, 9], [0, 10, 11], [5], [6, 6, 6, 1]]


def test_processed_logits_tokens_and_top_logprobs_match_the_reference(model):
    """Three steps of a batch of mixed settings on fixed random logits: each step's processed logits equal
    the reference's, the tokens are their argmax, the logprob and the top-N are those of the raw logits
    (and counts carry over steps: a generated token is counted once per time it was generated)."""
    sampler = model.engine.sampler
    params = [SamplingParams(c, num_prompt_tokens=len(p)) for c, p in zip(MIXED, PROMPTS)]
    token_ids = [list(p) for p in PROMPTS]
    generator = torch.Generator().manual_seed(0)
    try:
        for step in range(3):
            logits = torch.randn(len(MIXED), V, generator=generator) * 3
            # steer a few rows onto tokens they already generated, so counts reach 2
            logits[2, token_ids[2][-1]] += 10.0 * (step > 0)
            mask_eos = [len(ids) - len(p) < c.min_tokens for ids, p, c in zip(token_ids, PROMPTS, MIXED)]
            want = [reference_logits(row, p, ids[len(p):], c, m)
                    for row, p, ids, c, m in zip(logits.tolist(), PROMPTS, token_ids, MIXED, mask_eos)]
            tensors = sampler.sampling_tensors(params, token_ids, row_settings(params, mask_eos, EOS, V), V, logits.device)
            got = process_logits(logits, tensors)
            torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-5)
            tokens, logprobs, tops = sampler.sample(logits, params, token_ids, mask_eos, EOS)
            for r, (row, config) in enumerate(zip(want, MIXED)):
                assert tokens[r] == max(range(V), key=row.__getitem__)
                raw = reference_log_softmax(logits[r].tolist())
                assert logprobs[r] == pytest.approx(raw[tokens[r]], abs=1e-5)
                if config.top_logprobs:
                    ranked = sorted(range(V), key=lambda t: -raw[t])[:config.top_logprobs]
                    assert list(tops[r]) == ranked
                    assert list(tops[r].values()) == pytest.approx([raw[t] for t in ranked], abs=1e-5)
                else:
                    assert tops[r] is None
            for ids, t in zip(token_ids, tokens):
                ids.append(t)
        assert any(n >= 2 for n in Counter(token_ids[2][3:]).values())  # a count of 2 was exercised
    finally:
        for p in params:
            sampler.release(p)


def test_logit_bias_and_penalties_sample_the_reference_distribution():
    """Sampled rows (temperature 0.8) draw from softmax(reference logits / T)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -3.0, 2.9])
    config = GenerationConfig(temperature=0.8, logit_bias={6: 4.0, 5: -1.5}, presence_penalty=0.4,
                              frequency_penalty=0.3)
    prompt, generated = [0, 1], [7, 7, 2]
    want = torch.softmax(torch.tensor(reference_logits(logits.tolist(), prompt, generated, config, False)) / 0.8, -1)
    counts = torch.zeros(N, len(logits), dtype=torch.int32)
    for t in generated:
        counts[:, t] += 1
    seeds = torch.stack([torch.arange(N), torch.zeros(N, dtype=torch.int64)])
    bias_ids = torch.tensor([5, 6]).repeat(N)
    tensors = SamplingTensors(
        bias=(torch.arange(N).repeat_interleave(2), bias_ids, torch.tensor([-1.5, 4.0]).repeat(N)),
        frequency_penalty=torch.full((N,), 0.3), presence_penalty=torch.full((N,), 0.4), counts=counts,
        temperature=torch.full((N,), 0.8), top_k=torch.zeros(N, dtype=torch.int64), top_p=torch.ones(N),
        noise=sampling_noise(seeds, torch.zeros(N, dtype=torch.int64), len(logits)))
    got = torch.bincount(sample_logits(logits.repeat(N, 1), tensors), minlength=len(logits)).float() / N
    assert (got - want).abs().max() < 0.03


def test_a_mixed_batch_samples_what_each_row_samples_alone(model):
    """Seeded sampled rows with different settings: batched together, each row draws the tokens it draws
    alone (its noise is its own; its masks, biases and penalties are per row)."""
    sampler = model.engine.sampler
    configs = [GenerationConfig(temperature=1.0, seed=s, **extra) for s, extra in enumerate([
        {}, {"logit_bias": {2: 3.0}}, {"presence_penalty": 1.0, "top_k": 4}, {"frequency_penalty": 1.5, "min_p": 0.1},
        {"repetition_penalty": 1.4, "top_p": 0.8, "min_tokens": 3, "stop_token_ids": (5,)}])]
    logits = torch.randn(len(configs), V, generator=torch.Generator().manual_seed(1))
    token_ids = [[1, 2, 2, 3], [4, 5], [6, 6, 7], [8, 8, 8, 9], [0, 5]]
    mask_eos = [False, False, False, False, True]

    def draw(rows):
        params = [SamplingParams(configs[r], num_prompt_tokens=1) for r in rows]
        try:
            return sampler.sample(logits[rows], params, [token_ids[r] for r in rows], [mask_eos[r] for r in rows], EOS)
        finally:
            for p in params:
                sampler.release(p)
    together = draw(list(range(len(configs))))
    alone = [draw([r]) for r in range(len(configs))]
    assert together[0] == [a[0][0] for a in alone] and together[1] == [a[1][0] for a in alone]


def test_generation_config_checks_the_new_fields():
    for options, error in [({"stop_token_ids": [1]}, TypeError), ({"stop_token_ids": (True,)}, TypeError),
                           ({"stop_token_ids": (-1,)}, ValueError), ({"presence_penalty": 2.5}, ValueError),
                           ({"frequency_penalty": "1"}, TypeError), ({"logit_bias": {1: 101}}, ValueError),
                           ({"logit_bias": {"1": 1.0}}, TypeError), ({"logit_bias": [(1, 1.0)]}, TypeError),
                           ({"logit_bias": {1: float("nan")}}, ValueError), ({"top_logprobs": 21}, ValueError),
                           ({"top_logprobs": True}, TypeError)]:
        with pytest.raises(error):
            GenerationConfig(**options)
    config = GenerationConfig(logit_bias={9: 1, 2: -100})
    assert config.logit_bias == ((2, -100.0), (9, 1.0))
    assert GenerationConfig(logit_bias=config.logit_bias) == config  # dataclasses.replace round-trips


def test_out_of_vocab_stop_token_ids_and_logit_bias_are_refused(model):
    vocab = model.model.config.vocab_size
    for options, field in [({"stop_token_ids": [vocab]}, "stop_token_ids"), ({"logit_bias": {vocab + 5: 1.0}}, "logit_bias")]:
        with pytest.raises(ValueError, match=f"{field} has token id .* outside the vocabulary"):
            model.generate("hi", max_new_tokens=2, **options)


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def with_eos(model, eos: set[int]):
    saved = model.eos_token_ids
    model.eos_token_ids = eos
    return saved


def test_min_tokens_masks_eos_until_reached_and_ignore_eos_runs_to_length(model):
    greedy = model.generate("hello", max_new_tokens=8, return_dict=True)
    first = greedy.token_ids[0][0]
    saved = with_eos(model, {first})  # greedy's first token is now EOS: it ends at once
    try:
        assert model.generate("hello", max_new_tokens=8, return_dict=True).token_ids == [[first]]
        for n in (1, 3, 8):
            out = model.generate("hello", max_new_tokens=8, min_tokens=n, return_dict=True)
            assert len(out.token_ids[0]) > n or out.finish_reasons == ["length"]
            assert first not in out.token_ids[0][:n] and len(out.token_ids[0]) >= n
            if out.finish_reasons == ["eos"]:
                assert out.token_ids[0][-1] == first
        out = model.generate("hello", max_new_tokens=8, ignore_eos=True, return_dict=True)
        assert out.token_ids == greedy.token_ids and out.finish_reasons == ["length"]
        # sampled rows are masked too: over several seeds, none draws EOS before min_tokens
        for seed in range(6):
            out = model.generate("hello", max_new_tokens=6, min_tokens=6, temperature=1.5, seed=seed, return_dict=True)
            assert first not in out.token_ids[0] and out.finish_reasons == ["length"]
    finally:
        model.eos_token_ids = saved


def test_min_tokens_defers_stop_strings(model):
    text = model.generate("hello", max_new_tokens=12)
    stop = text[1:3]  # appears within the first 3 tokens (byte tokenizer: a token per character)
    assert model.generate("hello", max_new_tokens=12, stop=stop) == text[:text.index(stop)]
    later = model.generate("hello", max_new_tokens=12, stop=stop, min_tokens=6)
    cut = text.find(stop, 6 - len(stop))  # the first occurrence that ends at token 6 or later
    assert later == (text if cut < 0 else text[:cut]) and len(later) >= 6 - len(stop)
    streamed = "".join(model.stream("hello", max_new_tokens=12, stop=stop, min_tokens=6))
    assert streamed == later



def test_uniforms_stay_inside_the_open_unit_interval_at_the_extreme_bits():
    """The largest and smallest bit patterns give u strictly inside (0, 1), so the Gumbel noise is finite
    (an infinite noise would turn a masked -inf logit into NaN, which argmax picks)."""
    bits = torch.tensor([0, 1, 511, 2 ** 32 - 512, 2 ** 32 - 1], dtype=torch.int64)
    u = open_unit_uniform(bits)
    assert bool(((u > 0) & (u < 1)).all()), u
    assert torch.isfinite(-torch.log(-torch.log(u))).all()


def test_stop_token_ids_end_the_request_after_min_tokens(model):
    greedy = model.generate("hello", max_new_tokens=8, return_dict=True).token_ids[0]
    stop = greedy[2]
    out = model.generate("hello", max_new_tokens=8, stop_token_ids=[stop], return_dict=True)
    cut = greedy.index(stop)
    assert out.token_ids[0] == greedy[:cut + 1] and out.finish_reasons == ["stop"]  # the stop token is kept
    late = model.generate("hello", max_new_tokens=8, stop_token_ids=[stop], min_tokens=cut + 2, return_dict=True)
    assert stop not in late.token_ids[0][:cut + 2]  # masked below min_tokens
    out = model.generate("hello", max_new_tokens=8, stop_token_ids=[stop], ignore_eos=True, return_dict=True)
    assert out.finish_reasons == ["stop"]  # ignore_eos concerns EOS only


def test_generate_returns_top_logprobs_of_the_raw_logits(model):
    out = model.generate("hello", max_new_tokens=4, top_logprobs=5, logit_bias={0: 50.0}, return_dict=True)
    prompt = model.tokenizer("hello").input_ids
    ids = prompt + out.token_ids[0]
    raw = model.engine.prompt_logits(ids[:-1]).log_softmax(-1)[len(prompt) - 1:]
    assert out.token_ids[0] == [0] * 4  # the bias forces token 0
    for position, top in enumerate(out.top_logprobs[0]):
        values, indices = raw[position].topk(5)
        assert list(top) == indices.tolist()
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
    assert model.generate("hello", max_new_tokens=2, return_dict=True).top_logprobs == [[]]


def test_score_returns_top_logprobs_of_every_prompt_position(model):
    ids = model.tokenizer("hello there").input_ids
    out = model.score(ids, return_dict=True, top_logprobs=3)
    raw = model.engine.prompt_logits(ids[:-1]).log_softmax(-1)
    assert out.top_logprobs[0][0] is None
    for position, top in enumerate(out.top_logprobs[0][1:]):
        values, indices = raw[position].topk(3)
        assert list(top) == indices.tolist()
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="return_dict=True"):
        model.score(ids, top_logprobs=3)


@pytest.mark.parametrize("rows,vocab", [(6, 7), (6, 1000)])  # below and above SMALL_LOGITS
def test_finite_rows_and_argmax_rows_equal_their_plain_torch_forms(rows, vocab):
    """finite_rows marks exactly the rows holding NaN, +inf or -inf (as isfinite(x).all(-1)); argmax_rows takes the
    first largest index (ties included) as x.argmax(-1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=g)
    x[1, 3], x[2, -1], x[3, 0], x[4, 2] = float("nan"), float("inf"), float("-inf"), x[4].max() + 1
    x[4, vocab - 1] = x[4, 2]  # a tie: the first wins
    assert torch.equal(finite_rows(x), torch.isfinite(x).all(-1))
    assert finite_rows(x).tolist() == [True, False, False, False, True, True]
    finite = torch.isfinite(x).all(-1)
    assert torch.equal(argmax_rows(x)[finite], x.argmax(-1)[finite]) and int(argmax_rows(x)[4]) == 2


@pytest.mark.parametrize("rows,vocab", [(1, 1), (7, 5), (9, 64), (6, 1000), (3, 32000)])
def test_greedy_rows_in_c_equal_argmax_and_log_softmax(rows, vocab):
    """kernels/cpu_native.greedy_rows (an all-greedy CPU step's C loop): each row's first largest index (ties: the
    first, also across the 64-wide blocks it scans) and log_softmax there, in float64 from float32 sums
    (within 1e-5); -1 for rows holding NaN, +inf or -inf; strided rows (a slice of a wider tensor) read right."""
    from tritonq.kernels.cpu import native as cpu_native
    g = torch.Generator().manual_seed(rows * vocab)
    wide = torch.randn(rows, vocab + 3, generator=g) * 4
    x = wide[:, 1:vocab + 1]  # rows stride vocab + 3 apart
    if rows >= 6:
        x[1, vocab // 2], x[2, -1], x[3, 0] = float("nan"), float("inf"), float("-inf")
        x[4, vocab - 1] = x[4, 0] = x[4].max() + 1  # a tie: the first wins
        x[5, vocab // 3 + 64 if vocab > 200 else 0] = x[5].max() + 2
    got = cpu_native.greedy_rows(x)
    assert got is not None, "the C kernels did not build (see the log)"
    tokens, logprobs = got
    finite = torch.isfinite(x).all(-1)
    expected = torch.where(finite, x.argmax(-1), -1)
    assert tokens == expected.tolist()
    reference = x.double().log_softmax(-1).gather(1, x.argmax(-1, keepdim=True))[:, 0]
    for t, lp, ref in zip(tokens, logprobs, reference.tolist()):
        if t >= 0:
            assert abs(lp - ref) < 1e-5


def test_an_all_greedy_step_samples_the_same_in_c_and_torch(monkeypatch):
    """Sampler.sample on an all-greedy step without top logprobs takes the C loop; with it unavailable, torch's ops
    give the same tokens, the same logprobs (within 1e-5) and None for a non-finite row."""
    from tritonq.engine.sampler import Sampler
    from tritonq.kernels.cpu import native as cpu_native
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g) * 3
    logits[2, 7] = float("nan")
    params = [SamplingParams(GenerationConfig(max_new_tokens=4)) for _ in range(5)]
    ids = [[1, 2, 3]] * 5
    calls = []
    native = cpu_native.greedy_rows
    monkeypatch.setattr(cpu_native, "greedy_rows", lambda x: calls.append(1) or native(x))
    c_tokens, c_logprobs, c_top = Sampler().sample(logits, params, ids)
    assert calls == [1]
    monkeypatch.setattr(cpu_native, "greedy_rows", lambda x: None)
    t_tokens, t_logprobs, t_top = Sampler().sample(logits, params, ids)
    assert c_tokens == t_tokens and c_tokens[2] is None and c_logprobs[2] is None and c_top == t_top == [None] * 5
    assert all(abs(a - b) < 1e-5 for a, b in zip(c_logprobs, t_logprobs) if a is not None)
