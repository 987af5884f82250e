"""The batched sampler's min_p filter and EOS mask against plain-torch references, and min_tokens /
ignore_eos / tiny temperatures end to end on a tiny Llama (the reference: the same model's greedy run)."""
import pytest
import torch

from tritonq.engine.runner import open_unit_uniform, sample_logits, sampling_noise

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
    tokens = sample_logits(rows, torch.full((N,), temperature), torch.full((N,), top_k), torch.ones(N), None, None,
                           noise, filters=top_k > 0, min_p=torch.full((N,), min_p))
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
    tokens = sample_logits(logits, torch.tensor([1.0, 1.0, 0.0]), torch.zeros(3, dtype=torch.int64), torch.ones(3),
                           None, None, noise, filters=False, min_p=torch.tensor([0.5, 0.0, 0.9]))
    assert tokens.tolist() == [2, 0, 0]  # row 0: p0 / pmax = e^-2 < 0.5, dropped; row 1: kept; row 2: argmax


@pytest.fixture(scope="module")
def model(tiny_llama_model):
    return tiny_llama_model


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
    streamed = "".join(model.generate("hello", max_new_tokens=12, stop=stop, min_tokens=6, stream=True))
    assert streamed == later



def test_uniforms_stay_inside_the_open_unit_interval_at_the_extreme_bits():
    """The largest and smallest bit patterns give u strictly inside (0, 1), so the Gumbel noise is finite
    (an infinite noise would turn a masked -inf logit into NaN, which argmax picks)."""
    bits = torch.tensor([0, 1, 511, 2 ** 32 - 512, 2 ** 32 - 1], dtype=torch.int64)
    u = open_unit_uniform(bits)
    assert bool(((u > 0) & (u < 1)).all()), u
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
