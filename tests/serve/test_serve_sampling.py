"""The sampling surface of the server through the official `openai` client against a real
`python -m tritonq.serve` on 127.0.0.1: presence / frequency penalties, logit_bias, stop_token_ids,
top-N logprobs (completions `logprobs`, chat `logprobs` + `top_logprobs`, streamed and not) and `echo`
with prompt logprobs (lm-eval's `local-completions` call: echo + logprobs + max_tokens 0 or 1).

The reference is the offline Model on the same checkpoint and backend (whose sampler is checked
against plain references in tests/engine/test_sampler.py) and Model.score for prompt logprobs.
"""
import concurrent.futures

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve_util import MODEL_NAME, Server  # noqa: E402

PROMPT = "Hello, tritonq!"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    s = Server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "8")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)


def completion_top(tokenizer, sampled: int, logprob: float, top: dict[int, float]) -> dict[str, float]:
    """The completions top_logprobs entry of one token: the sampled token's text and logprob, then the
    alternatives' (vLLM's shape; texts that decode alike keep the first)."""
    entry = {tokenizer.decode([sampled]): logprob}
    for t, lp in top.items():
        entry.setdefault(tokenizer.decode([t]), lp)
    return entry


def assert_dicts_close(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_top_logprobs(client, reference, stream):
    want = reference.generate(PROMPT, max_new_tokens=6, top_logprobs=5, return_dict=True)
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=5,
                                      stream=stream)
    chunks = list(reply) if stream else [reply]
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = sum((lp.tokens for lp in logprobs), [])
    token_logprobs = sum((lp.token_logprobs for lp in logprobs), [])
    tops = sum((lp.top_logprobs for lp in logprobs), [])
    offsets = sum((lp.text_offset for lp in logprobs), [])
    tok = reference.tokenizer
    assert tokens == [tok.decode([t]) for t in want.token_ids[0]]
    assert token_logprobs == pytest.approx(want.logprobs[0], abs=1e-4)
    assert offsets == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    for top, sampled, lp, alternatives in zip(tops, want.token_ids[0], want.logprobs[0], want.top_logprobs[0]):
        assert_dicts_close(top, completion_top(tok, sampled, lp, alternatives))


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs(client, reference, stream):
    want = reference.chat(MESSAGES, max_new_tokens=5, temperature=0, top_logprobs=3, return_dict=True)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3, stream=stream)
    chunks = list(reply) if stream else [reply]
    content = sum((c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs), [])
    tok = reference.tokenizer
    assert [c.token for c in content] == [tok.decode([t]) for t in want.token_ids[0]]
    assert [c.logprob for c in content] == pytest.approx(want.logprobs[0], abs=1e-4)
    for entry, alternatives in zip(content, want.top_logprobs[0]):
        assert [a.token for a in entry.top_logprobs] == [tok.decode([t]) for t in alternatives]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(list(alternatives.values()), abs=1e-4)
        assert all(a.bytes == list(a.token.encode()) for a in entry.top_logprobs)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_is_the_lm_eval_call(client, reference, max_tokens):
    """lm-eval's local-completions: echo + logprobs + max_tokens 0 (or 1); the prompt's token logprobs are
    Model.score's, entry 0 null; top_logprobs hold the prompt token and the most likely ones."""
    ids = reference.tokenizer(PROMPT).input_ids
    scored = reference.score(PROMPT, return_dict=True, top_logprobs=2)
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                      logprobs=2, echo=True)
    choice = reply.choices[0]
    generated = reference.generate(PROMPT, max_new_tokens=max_tokens, return_dict=True) if max_tokens else None
    assert choice.text == PROMPT + (generated.text[0] if generated else "")
    lp, tok = choice.logprobs, reference.tokenizer
    n = len(ids)
    assert lp.tokens[:n] == [tok.decode([t]) for t in ids] and len(lp.tokens) == n + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(scored.logprobs[0][1:], abs=1e-4)
    for position in range(1, n):
        assert_dicts_close(lp.top_logprobs[position], completion_top(tok, ids[position], scored.logprobs[0][position],
                                                                     scored.top_logprobs[0][position]))
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    if generated:
        assert lp.token_logprobs[n:] == pytest.approx(generated.logprobs[0], abs=1e-4)


def test_echo_streamed_and_without_logprobs(client, reference):
    generated = reference.generate([5, 6, 7], max_new_tokens=4)
    prompt_text = reference.tokenizer.decode([5, 6, 7])
    reply = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0, echo=True)
    assert reply.choices[0].text == prompt_text + generated and reply.choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                            logprobs=0, stream=True, n=2))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.text for c in mine) == PROMPT + reference.generate(PROMPT, max_new_tokens=4)
        tokens = sum((c.logprobs.tokens for c in mine if c.logprobs), [])
        assert len(tokens) == len(reference.tokenizer(PROMPT).input_ids) + 4
        assert mine[0].logprobs.token_logprobs[0] is None


SETTINGS = [  # every sampling field beyond temperature / top_p, alone and mixed
    {"min_p": 0.3},
    {"ignore_eos": True, "min_tokens": 3, "top_k": 5},
    {"repetition_penalty": 1.3},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"presence_penalty": -1.0, "frequency_penalty": 0.5},
    {"logit_bias": {"65": 5.0, "66": -100}},
    {"stop_token_ids": "third"},
    {"frequency_penalty": 1.0, "logit_bias": {"70": 3.0}, "min_tokens": 2, "stop_token_ids": "third"},
]


def _options(reference, settings: dict) -> tuple[dict, dict]:
    """(openai client kwargs, Model.generate options) of one SETTINGS entry; "third" is the third token the
    plain greedy run generates."""
    settings = dict(settings)
    if settings.get("stop_token_ids") == "third":
        settings["stop_token_ids"] = [reference.generate(PROMPT, max_new_tokens=3, return_dict=True).token_ids[0][2]]
    local = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in settings.items()}
    extra = {k: settings.pop(k) for k in ("stop_token_ids", "min_tokens", "min_p", "ignore_eos", "top_k",
                                          "repetition_penalty") if k in settings}
    return settings | ({"extra_body": extra} if extra else {}), local


def test_each_sampling_field_and_a_mixed_batch_match_the_solo_reference(client, reference):
    """Every SETTINGS entry sent at once (one batch on the server), greedy and seeded-sampled: each reply
    equals Model.generate of that request alone."""
    jobs = []
    for settings in SETTINGS:
        remote, local = _options(reference, settings)
        for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
            jobs.append((remote | sampling, local | sampling))
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(lambda job: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                                                      **job[0]), jobs))
    for (remote, local), reply in zip(jobs, replies):
        want = reference.generate(PROMPT, max_new_tokens=12, return_dict=True, **local)
        assert reply.choices[0].text == want.text[0], remote
        assert reply.choices[0].finish_reason == {"eos": "stop"}.get(want.finish_reasons[0], want.finish_reasons[0])


def test_penalties_and_bias_change_the_output_as_specified(client, reference):
    """Not only equal to the reference: each field does what it says on the wire."""
    plain = reference.generate(PROMPT, max_new_tokens=12, return_dict=True).token_ids[0]
    a = reference.tokenizer("A", add_special_tokens=False).input_ids[0]
    forced = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.8,
                                       logit_bias={str(a): 100})
    assert forced.choices[0].text == "A" * 6
    stop = plain[2]
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"stop_token_ids": [stop]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == plain.index(stop) + 1
