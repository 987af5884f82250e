"""Model.generate / chat behaviour: edge cases, cache limits, sampling controls, streaming, many prompts.

The token-level match with transformers is in tests/models/test_llama.py; here the reference
is the greedy output of the same model, against which each option's effect is checked.
"""
import concurrent.futures
import itertools
import threading

import pytest
import torch
from tolerances import BATCH_ATOL, assert_greedy_equal, first_near_tie, solo_runs

import tritonq
from tritonq.demo import write_tiny_llama


@pytest.fixture(scope="module")
def model(tiny_llama_model):
    return tiny_llama_model


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


def encode(model, prompts: list[str]) -> list[list[int]]:
    return [model.tokenizer(p).input_ids for p in prompts]


def test_more_prompts_than_max_num_seqs_each_equal_to_alone(model):
    prompts = encode(model, ["a", "hello there", "xyz", "b", "qrs", "hello", "zz"])  # max_num_seqs=3: they queue
    alone = solo_runs(model, prompts, max_new_tokens=6)
    assert_greedy_equal(model, prompts, model.generate(prompts, max_new_tokens=6, return_dict=True), alone)
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
    prompts = encode(model, ["a", "hello there", "xyz"])
    alone = solo_runs(model, prompts, max_new_tokens=8)
    assert_greedy_equal(model, prompts, model.generate(prompts, max_new_tokens=8, return_dict=True), alone)


def test_stream_pieces_concatenate_to_the_text(model):
    pieces = list(model.stream("hello", max_new_tokens=8))
    assert len(pieces) > 1 and "".join(pieces) == model.generate("hello", max_new_tokens=8)


def test_stream_of_several_prompts_yields_index_and_piece(model):
    prompts = ["hello", "xy", "a"]
    texts = ["", "", ""]
    for index, piece in model.stream(prompts, max_new_tokens=8):
        texts[index] += piece
    assert texts == model.generate(prompts, max_new_tokens=8)


def test_stream_chat_pieces_concatenate_to_the_chat_reply(model):
    messages = [{"role": "user", "content": "hi"}]
    pieces = list(model.stream_chat(messages, max_new_tokens=4))
    assert all(isinstance(p, str) for p in pieces) and "".join(pieces) == model.chat(messages, max_new_tokens=4)


def test_closing_a_stream_early_frees_its_blocks(model):
    stream = model.stream(["hello", "xy"], max_new_tokens=8)
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
        streamed = "".join(model.stream("hello", max_new_tokens=12, stop=stop))
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


def test_chat_prompt_renders_tools_and_refuses_a_template_that_ignores_them(model, monkeypatch):
    """Model.chat_prompt (Model.chat's and the server's one templating path) against the tokenizer's own
    apply_chat_template: the same ids, with and without tools; a template without a tools block is refused."""
    messages = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    tokenizer = model.tokenizer
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert model.chat_prompt(messages) == tokenizer(plain, add_special_tokens=False).input_ids
    with pytest.raises(ValueError, match="^tools: this model's chat template does not render tools"):
        model.chat_prompt(messages, tools=[tool])
    monkeypatch.setattr(tokenizer, "chat_template", "{% for t in tools or [] %}tool {{ t.function.name }}\n"
                        "{% endfor %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ")
    with_tools = tokenizer.apply_chat_template(messages, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert with_tools.startswith("tool get_time\n")
    assert model.chat_prompt(messages, tools=[tool]) == tokenizer(with_tools, add_special_tokens=False).input_ids


def test_return_dict_has_logprobs_and_timing(model):
    out = model.generate(["hello", "a"], max_new_tokens=5, return_dict=True)
    assert [len(t) for t in out.token_ids] == [len(lp) for lp in out.logprobs]
    assert all(lp <= 0 for seq in out.logprobs for lp in seq)
    assert all(t > 0 for t in out.time_to_first_token_s) and out.decode_tokens_per_s > 0
    assert out.finish_reasons == ["length", "length"]


def test_bad_options_raise(model):
    with pytest.raises(ValueError, match="top_p"):
        model.generate("a", top_p=0.0)
    with pytest.raises(TypeError, match=r"Model\.stream\(prompts"):  # one return type per method
        model.generate("a", stream=True, return_dict=True)
    with pytest.raises(TypeError, match="prompts must be"):
        model.generate(3.5)
    with pytest.raises(ValueError, match="non-empty"):
        model.generate("a", stop="")


def test_chat_takes_openai_text_parts_and_refuses_other_parts(model):
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    plain = [{"role": "user", "content": "h\ni"}]  # text parts joined with newlines, as vLLM
    assert model.chat(parts, max_new_tokens=5) == model.chat(plain, max_new_tokens=5)
    image = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}]
    with pytest.raises(ValueError, match="message 0 content part 1 has type 'image_url'; only 'text' parts"):
        model.chat(image, max_new_tokens=5)
    assert parts[0]["content"][0] == {"type": "text", "text": "h"}  # the caller's messages are not changed


# ---- one Model, many callers -------------------------------------------------------------------------

TEXTS = ["hello", "xy", "a", "hi there", "zzz"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A Model with room for every caller at once (score needs free blocks while others generate)."""
    folder = write_tiny_llama(tmp_path_factory.mktemp("shared"), hidden_size=32, num_layers=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITONQ_BACKEND", "torch")
        yield tritonq.load(folder, max_num_seqs=4, max_seq_len=32, kv_cache_gb=0.01)


@pytest.fixture(scope="module")
def prompts(shared):
    return encode(shared, TEXTS)


def assert_no_near_tie(model, prompts, alone):
    """Texts of batched runs may be compared exactly with their solo runs: no greedy pick is a near tie."""
    for p, ids in zip(prompts, alone.token_ids):
        assert first_near_tie(model, p, ids) == len(ids), "pick prompts without near ties"


def test_interleaved_generators_each_get_their_own_output(shared, prompts):
    """g = stream(A); next(g); generate(B); list(g) looped forever, and two interleaved
    streams exchanged text: now each caller's outputs are routed to it by request id."""
    alone = solo_runs(shared, prompts, max_new_tokens=8)
    texts = alone.text
    assert_no_near_tie(shared, prompts, alone)  # so texts compare exactly
    g = shared.stream(prompts[0], max_new_tokens=8)
    first = next(g)
    b = shared.generate(prompts[1], max_new_tokens=8, return_dict=True)
    assert b.text == texts[1:2]
    assert first + "".join(g) == texts[0]
    streams = [shared.stream(p, max_new_tokens=8) for p in prompts[2:4]]
    got = ["", ""]
    for pieces in itertools.zip_longest(*streams, fillvalue=""):
        got = [t + p for t, p in zip(got, pieces)]
    assert got == texts[2:4]
    bm = shared.engine.block_manager
    assert not shared.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_an_abandoned_generator_aborts_only_its_requests(shared, prompts):
    alone = solo_runs(shared, prompts[:2], max_new_tokens=8)
    assert_no_near_tie(shared, prompts[:2], alone)
    g = shared.stream(prompts[0], max_new_tokens=8)
    next(g)
    h = shared.stream(prompts[1], max_new_tokens=8)
    first = next(h)
    del g  # closed by the garbage collector: its request is aborted, h's goes on
    assert first + "".join(h) == alone.text[1]
    assert not shared.engine.has_unfinished()


def test_threads_calling_one_model_each_get_their_solo_output(shared, prompts):
    """4 threads x (generate, stream, chat, score) at once on one Model, each twice: every result equals
    the call alone (tokens up to a near tie, logprobs and scores within the fp32 batch tolerance)."""
    alone = solo_runs(shared, prompts, max_new_tokens=8)
    assert_no_near_tie(shared, prompts, alone)  # streamed and chat texts compare exactly
    messages = [{"role": "user", "content": "hi"}]
    chat_alone = shared.chat(messages, max_new_tokens=6)
    score_alone = shared.score(prompts)
    barrier = threading.Barrier(4)

    def generate():
        barrier.wait()
        return [shared.generate(prompts, max_new_tokens=8, return_dict=True) for _ in range(2)]

    def stream():
        barrier.wait()
        return ["".join(shared.stream(prompts[3], max_new_tokens=8)) for _ in range(2)]

    def chat():
        barrier.wait()
        return [shared.chat(messages, max_new_tokens=6) for _ in range(2)]

    def score():
        barrier.wait()
        return [shared.score(prompts) for _ in range(2)]
    steppers, step = set(), shared.engine.step

    def recorded_step():
        steppers.add(threading.get_ident())
        return step()
    shared.engine.step = recorded_step
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(f) for f in (generate, stream, chat, score)]
            generated, streamed, chatted, scored = [f.result(timeout=300) for f in futures]
    finally:
        del shared.engine.step
    assert len(steppers) > 1  # the callers really shared the engine, each stepping it in turn
    for out in generated:
        assert_greedy_equal(shared, prompts, out, alone)
    assert streamed == [alone.text[3]] * 2
    assert chatted == [chat_alone] * 2
    for result in scored:
        for got, want in zip(result, score_alone, strict=True):
            torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(want[1:]), atol=BATCH_ATOL, rtol=0)
    bm = shared.engine.block_manager
    assert not shared.engine.has_unfinished() and bm.num_free_blocks == bm.num_blocks
