"""`python -m tritonq.serve` as a real process on 127.0.0.1, checked with the openai client and httpx.

The server runs a tiny random Llama (tritonq.demo.write_tiny_llama, byte tokenizer) on the torch
reference backend (TRITONQ_BACKEND=torch: the kernels have their own tests, and the interpreter
would take minutes per request here); the reference outputs come from Model.generate / Model.chat
on the same checkpoint and backend in this process, one prompt at a time.
"""
import asyncio
import json
import signal
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve_util import KEY, MAX_SEQ_LEN, MODEL_NAME, Server  # noqa: E402


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    s = Server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "64")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def strict(checkpoint, tmp_path_factory):
    """One sequence at a time, four waiting at most, an API key: the 401 / 429 cases."""
    s = Server(checkpoint, tmp_path_factory.mktemp("log") / "strict.log", "--max-num-seqs", "1",
               "--max-waiting", "4", "--api-key", KEY)
    yield s
    s.stop()


def _client(server, key="none"):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, timeout=60, max_retries=0)


def test_openai_client_completions_match_generate(server, reference):
    client = _client(server)
    for prompt, max_tokens in [("Hello, tritonq!", 17), ("a", 5)]:
        expected = reference.generate(prompt, max_new_tokens=max_tokens, temperature=0, return_dict=True)
        prompt_tokens = len(reference.tokenizer(prompt).input_ids)
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert reply.choices[0].text == expected.text[0]
        assert reply.choices[0].finish_reason == "length"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (
            prompt_tokens, len(expected.token_ids[0]), prompt_tokens + len(expected.token_ids[0]))
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text[0]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids[0])
        assert all(c.usage is None for c in chunks[:-1])


def test_completions_batch_of_token_ids_and_n(server, reference):
    prompts = [[72, 101, 108], [97, 98, 99, 100, 101]]
    reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompts, "max_tokens": 6, "temperature": 0, "n": 2, "logprobs": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = reference.generate(prompts, max_new_tokens=6, temperature=0, return_dict=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c in body["choices"]:
        p = c["index"] // 2
        assert c["text"] == expected.text[p]
        assert len(c["logprobs"]["token_logprobs"]) == 6
        assert c["logprobs"]["token_logprobs"] == pytest.approx(expected.logprobs[p], abs=1e-3)
    assert body["usage"] == {"prompt_tokens": 8, "completion_tokens": 24, "total_tokens": 32}


def test_openai_client_chat_matches_chat(server, reference):
    client = _client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is int4?"}]
    expected = reference.chat(messages, max_new_tokens=11, temperature=0)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=11,
                                           temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    text = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(reference.tokenizer(text, add_special_tokens=False).input_ids)
    assert reply.usage.prompt_tokens == prompt_tokens and reply.usage.completion_tokens == 11
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=11, temperature=0,
                                                 stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def _prompt(i: int) -> str:
    return f"request {i}: " + "xyz"[i % 3] * (i % 7) + str(i * 37)


async def _stream_text(client, url: str, prompt: str, max_tokens: int) -> tuple[str, str, bool]:
    text, reason, done = "", None, False
    async with client.stream("POST", url, json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                                "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason, done


def test_32_concurrent_streams_match_solo_greedy(server, reference):
    max_tokens = [4 + i % 9 for i in range(32)]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[_stream_text(client, f"{server.url}/v1/completions", _prompt(i), m)
                                          for i, m in enumerate(max_tokens)])
    results = asyncio.run(asyncio.wait_for(run(), 300))
    for i, (text, reason, done) in enumerate(results):
        assert done and reason == "length"
        assert text == reference.generate(_prompt(i), max_new_tokens=max_tokens[i], temperature=0), i
    assert server.metric("num_requests_running") == 0
    assert server.metric("num_requests_waiting") == 0
    assert server.metric("kv_cache_free_blocks") == server.metric("kv_cache_total_blocks")
    assert server.metric("time_to_first_token_seconds_count") >= 32


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    finished_before = server.metric("request_success_total")
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "a long one", "max_tokens": MAX_SEQ_LEN - 20, "temperature": 0,
            "stream": True}) as r:
        for line in r.iter_lines():
            if line:  # the first token came: the request holds blocks (checked before the client leaves)
                assert server.metric("kv_cache_free_blocks") < server.metric("kv_cache_total_blocks")
                break
    deadline = time.time() + 20
    while server.metric("kv_cache_free_blocks") != server.metric("kv_cache_total_blocks") and time.time() < deadline:
        time.sleep(0.1)
    assert server.metric("kv_cache_free_blocks") == server.metric("kv_cache_total_blocks")
    assert server.metric("num_requests_running") == 0
    assert server.metric("request_success_total") == finished_before  # aborted, not run to its end
    assert server.metric("generation_tokens_total") > 0


def _post(server, path, body=None, key=KEY, content=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is not None:
        headers["Content-Type"] = "application/json"
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=headers, timeout=60)


def _error(reply, status: int) -> str:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error["message"]


def test_error_table(strict):
    ok = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    assert _post(strict, "/v1/completions", ok).status_code == 200
    assert "API key" in _error(_post(strict, "/v1/completions", ok, key=None), 401)
    assert "API key" in _error(_post(strict, "/v1/completions", ok, key="wrong"), 401)
    assert httpx.get(f"{strict.url}/health").status_code == 200  # health and metrics need no key
    assert "`gpt-4`" in _error(_post(strict, "/v1/completions", ok | {"model": "gpt-4"}), 404)
    message = _error(_post(strict, "/v1/completions", ok | {"prompt": "x" * 100, "max_tokens": 500}), 400)
    assert "100" in message and "500" in message and str(MAX_SEQ_LEN) in message
    message = _error(_post(strict, "/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": MAX_SEQ_LEN,
                                                            "messages": [{"role": "user", "content": "hi"}]}), 400)
    assert str(MAX_SEQ_LEN) in message
    assert "temperature" in _error(_post(strict, "/v1/completions", ok | {"temperature": -1}), 400)
    assert "top_p" in _error(_post(strict, "/v1/completions", ok | {"top_p": 1.5}), 400)
    assert "n" == _post(strict, "/v1/completions", ok | {"n": 0}).json()["error"]["param"]
    assert "stream_options" in _error(_post(strict, "/v1/completions", ok | {"stream_options": {"include_usage": True}}), 400)
    assert "max_tokens=0" in _error(_post(strict, "/v1/completions", ok | {"max_tokens": 0}), 400)
    assert "JSON" in _error(_post(strict, "/v1/completions", content=b'{"model": "tiny", "prompt": '), 400)
    assert "prompt" in _error(_post(strict, "/v1/completions", {"model": MODEL_NAME, "prompt": [1, "a"]}), 400)
    assert "messages" in _error(_post(strict, "/v1/chat/completions", {"model": MODEL_NAME, "messages": []}), 400)

    # 429: --max-num-seqs 1 --max-waiting 4. A with n=4 runs one choice and queues three (each ~500 tokens,
    # so they wait for seconds); a request adding 4 more to those 3 is refused, one adding 1 is not.
    long = ok | {"max_tokens": MAX_SEQ_LEN - 10, "stream": True, "n": 4}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        with client.stream("POST", f"{strict.url}/v1/completions", json=long) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the response, and the server aborts
            next(lines)  # its first token came: one runs, three wait
            assert "--max-waiting" in _error(_post(strict, "/v1/completions", ok | {"n": 4}), 429)
            assert "--max-waiting" in _error(_post(strict, "/v1/completions", long), 429)


def test_sigterm_ends_streams_with_an_error_and_exits_cleanly(strict):
    with httpx.stream("POST", f"{strict.url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": MAX_SEQ_LEN - 10, "stream": True,
                            "ignore_eos": True}) as r:  # a sampled EOS must not end it before the signal
        lines = []
        for line in r.iter_lines():
            if line and not lines:
                strict.proc.send_signal(signal.SIGTERM)
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
    assert strict.proc.wait(30) == 0


def test_bench_serve_reports_rates_and_offline_ratio(tmp_path, monkeypatch):
    from tritonq.bench import serve as bench_serve
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITONQ_BACKEND", "torch")
    out = tmp_path / "serve.json"
    bench_serve.main(["--hidden", "64", "--num-prompts", "6", "--input-len", "8", "--output-len", "6",
                      "--rates", "50,inf", "--repeat", "1", "--max-seq-len", "64", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["rate"] for r in rows] == [50.0, "inf"]
    for r in rows:
        assert r["requests"] == 6 and r["out_tok/s"] > 0 and r["offline_out_tok/s"] > 0
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["server/offline"] == pytest.approx(
            r["out_tok/s"] / r["offline_out_tok/s"])
