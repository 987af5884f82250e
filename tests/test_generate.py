"""Model.generate / chat behaviour: edge cases, cache limits, sampling controls, streaming, many prompts.

The token-level match with transformers is in tests/models/test_llama.py; here the reference
is the greedy output of the same model, against which each option's effect is checked.
"""
import pytest

import tritonq
from tritonq.demo import write_tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden_size=32, num_layers=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        yield tritonq.load(folder, max_num_seqs=3, max_seq_len=32)


@pytest.fixture(autouse=True)
def _torch_backend(monkeypatch):
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")


def test_max_new_tokens_zero_returns_empty_text(model):
    out = model.generate(["ab", "c"], max_new_tokens=0, return_dict=True)
    assert out.text == ["", ""] and out.token_ids == [[], []]


def test_empty_prompt_list_returns_empty_list(model):
    assert model.generate([], max_new_tokens=5) == []


def test_prompt_longer_than_cache_raises(model):
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model.generate("x" * 40, max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens=30"):
        model.generate("x" * 5, max_new_tokens=30)


def test_more_prompts_than_max_num_seqs_each_equal_to_alone(model):
    prompts = ["a", "hello there", "xyz", "b", "qrs", "hello", "zz"]  # max_num_seqs=3: they queue
    alone = [model.generate(p, max_new_tokens=6) for p in prompts]
    assert model.generate(prompts, max_new_tokens=6) == alone
    assert model.engine.block_manager.num_free_blocks == model.engine.block_manager.num_blocks


def test_eos_at_first_step_stops_that_sequence_only(model):
    prompts = ["hello", "xy"]
    greedy = model.generate(prompts, max_new_tokens=6, return_dict=True)
    first = greedy.token_ids[0][0]
    assert greedy.token_ids[1][0] != first, "pick prompts whose first greedy tokens differ"
    saved = model.eos_token_ids
    model.eos_token_ids = {first}
    try:
        out = model.generate(prompts, max_new_tokens=6, return_dict=True)
    finally:
        model.eos_token_ids = saved
    assert out.token_ids[0] == [first]
    assert out.token_ids[1] == greedy.token_ids[1][:len(out.token_ids[1])] and len(out.token_ids[1]) > 1


def test_batch_equals_each_prompt_alone(model):
    prompts = ["a", "hello there", "xyz"]
    assert model.generate(prompts, max_new_tokens=8) == [model.generate(p, max_new_tokens=8) for p in prompts]


def test_stream_pieces_concatenate_to_the_text(model):
    pieces = list(model.generate("hello", max_new_tokens=8, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == model.generate("hello", max_new_tokens=8)


def test_stream_of_several_prompts_yields_index_and_piece(model):
    prompts = ["hello", "xy", "a"]
    texts = ["", "", ""]
    for index, piece in model.generate(prompts, max_new_tokens=8, stream=True):
        texts[index] += piece
    assert texts == model.generate(prompts, max_new_tokens=8)


def test_closing_a_stream_early_frees_its_blocks(model):
    stream = model.generate(["hello", "xy"], max_new_tokens=8, stream=True)
    next(stream)
    stream.close()
    assert not model.engine.has_unfinished()
    assert model.engine.block_manager.num_free_blocks == model.engine.block_manager.num_blocks


def test_stop_string_truncates_text(model):
    text = model.generate("hello", max_new_tokens=8)
    stop = text[3:5]
    out = model.generate("hello", max_new_tokens=8, stop=[stop])
    assert out == text[:text.index(stop)]


def test_stream_with_stop_strings_equals_the_text(model):
    """Stops that straddle tokens (byte tokenizer: every 2-char stop does), that occur, and that
    only start to occur (the held character must still be flushed): streamed == non-streamed."""
    text = model.generate("hello", max_new_tokens=12)
    for stop in [text[3:5], text[5:8], text[3] + "\x00", text[-1] + "\x00", [text[6:8], text[2:4]]]:
        streamed = "".join(model.generate("hello", max_new_tokens=12, stop=stop, stream=True))
        plain = model.generate("hello", max_new_tokens=12, stop=stop)
        stops = [stop] if isinstance(stop, str) else stop
        cut = min([text.index(s) for s in stops if s in text], default=len(text))
        assert streamed == plain == text[:cut]


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    greedy = model.generate("hello", max_new_tokens=8)
    assert model.generate("hello", max_new_tokens=8, temperature=1.0, top_k=1, seed=0) == greedy
    a = model.generate("hello", max_new_tokens=8, temperature=1.5, top_p=0.9, seed=1)
    assert a == model.generate("hello", max_new_tokens=8, temperature=1.5, top_p=0.9, seed=1)
    samples = {model.generate("hello", max_new_tokens=8, temperature=1.5, seed=s) for s in range(4)}
    assert len(samples) > 1


def test_repetition_penalty_discourages_seen_tokens(model):
    prompt = list(range(60, 70))
    plain = model.generate(prompt, max_new_tokens=10, return_dict=True).token_ids[0]
    penalized = model.generate(prompt, max_new_tokens=10, repetition_penalty=100.0, return_dict=True).token_ids[0]
    assert len(set(penalized)) == len(penalized) and not set(penalized) & set(prompt)
    assert len(set(plain)) < len(plain)  # the random model repeats itself without the penalty


def test_chat_uses_the_template(model):
    messages = [{"role": "user", "content": "hi"}]
    templated = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert templated.endswith("assistant: ")
    ids = model.tokenizer(templated, add_special_tokens=False).input_ids
    assert model.chat(messages, max_new_tokens=5) == model.generate(ids, max_new_tokens=5)


def test_return_dict_has_logprobs_and_timing(model):
    out = model.generate(["hello", "a"], max_new_tokens=5, return_dict=True)
    assert [len(t) for t in out.token_ids] == [len(lp) for lp in out.logprobs]
    assert all(lp <= 0 for seq in out.logprobs for lp in seq)
    assert all(t > 0 for t in out.time_to_first_token_s) and out.decode_tokens_per_s > 0
    assert out.finish_reasons == ["length", "length"]


def test_bad_options_raise(model):
    with pytest.raises(ValueError, match="top_p"):
        model.generate("a", top_p=0.0)
    with pytest.raises(ValueError, match="cannot also return_dict"):
        model.generate("a", stream=True, return_dict=True)
    with pytest.raises(TypeError, match="prompts must be"):
        model.generate(3.5)
    with pytest.raises(ValueError, match="non-empty"):
        model.generate("a", stop="")
