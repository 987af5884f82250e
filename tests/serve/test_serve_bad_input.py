"""The red-team table against the server (the twin of tests/api/test_bad_input.py): bad requests get a
4xx naming the culprit, and the server answers a normal request afterwards with the same output as
before; a failing engine step fails only its requests; a dead engine makes /health 503 and the
process exit non-zero.

One server process (tests/serve/serve_faulty.py: `python -m tritonq.serve` with ModelRunner.run failing
on demand) serves the whole module: --max-num-seqs 1 (so requests queue), --max-waiting 4, an API
key and a 100 kB body limit. The dead-engine case kills it, so it runs last.
"""
import json
import os
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serve_util import KEY, MAX_SEQ_LEN, MODEL_NAME, Server  # noqa: E402

MAX_WAITING = 4
MAX_BYTES = 100_000
AUTH = {"Authorization": f"Bearer {KEY}"}
NORMAL = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tritonq.demo import write_tiny_llama
    return write_tiny_llama(tmp_path_factory.mktemp("serve") / "tiny", hidden_size=128)


@pytest.fixture(scope="module")
def vocab_size(checkpoint):
    return json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory):
    return tmp_path_factory.mktemp("fault") / "fault"


def _inject(fault_file, kind: str) -> None:
    """Arm the server's one-shot fault atomically: the server polls the file at every step and must never
    read it half-written (an empty read would be taken for another fault)."""
    staged = fault_file.with_suffix(".tmp")
    staged.write_text(kind)
    os.replace(staged, fault_file)


@pytest.fixture(scope="module")
def server(checkpoint, fault_file, tmp_path_factory):
    s = Server(checkpoint, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "1",
               "--max-waiting", str(MAX_WAITING), "--api-key", KEY, "--max-request-bytes", str(MAX_BYTES),
               entry=[str(Path(__file__).parent / "serve_faulty.py")],
               env={"TRITONQ_TEST_FAULT_FILE": str(fault_file)}, key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def normal_text(server):
    """The server's answer to NORMAL before any bad request: later answers must equal it."""
    return _text(_post(server, NORMAL))


def _post(server, body=None, path="/v1/completions", content=None, headers=AUTH, timeout=60):
    headers = dict(headers) | ({"Content-Type": "application/json"} if content is not None else {})
    return httpx.post(f"{server.url}{path}", json=body, content=content, headers=headers, timeout=timeout)


def _error(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def _text(reply) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _chat(**extra) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | extra


def test_bad_token_ids_are_refused_naming_the_id(server, vocab_size, normal_text):
    for bad in (-1, vocab_size, 10**20):
        error = _error(_post(server, NORMAL | {"prompt": [5, bad]}), 400)
        assert str(bad) in error["message"] and error["param"] == "prompt", error
        error = _error(_post(server, NORMAL | {"prompt": [[5, 6], [5, bad]]}), 400)
        assert str(bad) in error["message"] and "prompt 1" in error["message"], error
    assert "prompt" in _error(_post(server, NORMAL | {"prompt": [True, 5]}), 400)["message"]
    assert _text(_post(server, NORMAL)) == normal_text
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "tool_choice", "auto"),  # without tools
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "parallel_tool_calls", True),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "no_such_field", 1),
    ("/v1/completions", "suffix", "x"),
    ("/v1/completions", "no_such_field", 1),
])
def test_unimplemented_and_unknown_fields_are_refused(server, path, field, value):
    body = (_chat() if "chat" in path else dict(NORMAL)) | {field: value}
    error = _error(_post(server, body, path), 400)
    assert field in error["message"] and error["param"] == field, error
    if field == "no_such_field":
        assert "this server accepts" in error["message"] and "temperature" in error["message"]


def test_tools_with_a_template_that_ignores_them_are_refused(server):
    pytest.importorskip("xgrammar")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    error = _error(_post(server, _chat(tools=[tool]), "/v1/chat/completions"), 400)
    assert error["param"] == "tools" and "does not render tools" in error["message"], error


@pytest.mark.parametrize("path,extra,param,phrase", [
    ("/v1/completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs", "needs logprobs=true"),
    ("/v1/completions", {"logit_bias": {"abc": 1.0}}, "logit_bias", "'abc' is not a token id"),
    ("/v1/completions", {"logit_bias": {"-5": 1.0}}, "logit_bias", "'-5' is not a token id"),
    ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias", "must be in [-100, 100]"),
    ("/v1/completions", {"logit_bias": {"5": -101}}, "logit_bias", "must be in [-100, 100]"),
    ("/v1/completions", {"logit_bias": {"99999": 1.0}}, "logit_bias", "token id 99999 outside the vocabulary"),
    ("/v1/completions", {"stop_token_ids": [99999]}, "stop_token_ids", "token id 99999 outside the vocabulary"),
    ("/v1/completions", {"stop_token_ids": [-1]}, "stop_token_ids.0", "greater than or equal to 0"),
    ("/v1/completions", {"stop_token_ids": [True]}, "stop_token_ids.0", "valid integer"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "only meaningful with echo=true"),
])
def test_sampling_fields_out_of_range_are_400_naming_the_field(server, path, extra, param, phrase):
    body = (_chat() if "chat" in path else dict(NORMAL)) | extra
    error = _error(_post(server, body, path), 400)
    assert phrase in error["message"] and error["param"] == param, error


def test_unknown_field_in_a_message_and_in_stream_options(server):
    body = _chat(messages=[{"role": "user", "content": "hi", "nme": "x"}])
    assert "nme" in _error(_post(server, body, "/v1/chat/completions"), 400)["message"]
    body = dict(NORMAL, stream=True, stream_options={"include_usage": True, "extra": 1})
    assert "extra" in _error(_post(server, body), 400)["message"]


def test_the_openai_client_with_ordinary_arguments_is_accepted(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=60, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=4, temperature=0.7, top_p=0.9, seed=1, stop=["\n\n"], n=2, user="u", logprobs=True,
        top_logprobs=0, presence_penalty=0, frequency_penalty=0, tool_choice="none",
        response_format={"type": "text"})
    assert len(reply.choices) == 2
    reply = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, temperature=0, logprobs=0,
                                      stream=True, stream_options={"include_usage": True})
    assert list(reply)[-1].usage.completion_tokens == 3


def test_vllm_extensions_are_honoured_or_refused(server):
    for name, value in (("min_p", 0.1), ("min_tokens", 2), ("ignore_eos", True)):
        reply = _post(server, NORMAL | {name: value})
        assert reply.status_code == 200, reply.text
    for name, value in (("min_p", 1.5), ("min_tokens", -1), ("ignore_eos", "yes")):
        assert _error(_post(server, NORMAL | {name: value}), 400)["param"] == name


@pytest.mark.parametrize("field,value", [
    ("stream", "yes"), ("max_tokens", 2.5), ("max_tokens", "5"), ("temperature", "0.5"), ("n", True),
    ("seed", 1.0), ("logprobs", False), ("top_k", "3"),
])
def test_strict_types(server, field, value):
    assert _error(_post(server, NORMAL | {field: value}), 400)["param"] == field


def test_huge_body_is_refused_before_parsing(server, normal_text):
    big = json.dumps(NORMAL | {"prompt": "x" * (MAX_BYTES + 1)}).encode()
    assert str(MAX_BYTES) in _error(_post(server, content=big), 413)["message"]

    def chunks():  # no Content-Length: the body is counted as it streams in
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]
    reply = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                       headers=AUTH | {"Content-Type": "application/json"})
    assert str(MAX_BYTES) in _error(reply, 413)["message"]
    assert _text(_post(server, NORMAL)) == normal_text


def test_lone_surrogate_is_a_400(server, normal_text):
    raw = b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'
    error = _error(_post(server, content=raw), 400)
    assert error["param"] == "prompt" and "surrogate" in error["message"]
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    error = _error(_post(server, path="/v1/chat/completions", content=raw), 400)
    assert error["param"] == "messages.0.content", error
    assert _text(_post(server, NORMAL)) == normal_text


def test_n_times_prompts_counts_against_max_waiting(server):
    error = _error(_post(server, NORMAL | {"prompt": [[5], [6], [7]], "n": 2}), 400)
    assert "--max-waiting" in error["message"] and "6" in error["message"]
    long = NORMAL | {"max_tokens": MAX_SEQ_LEN - 10, "stream": True, "n": MAX_WAITING}
    with httpx.Client(timeout=60, headers=AUTH) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json=long) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the response, and the server aborts
            next(lines)  # one choice runs (--max-num-seqs 1), three wait
            reply = _post(server, NORMAL | {"n": 2})
            _error(reply, 429)
            assert int(reply.headers["Retry-After"]) >= 1


def test_auth_comes_before_the_body(server):
    assert _error(_post(server, content=b"{not json", headers={}), 401)
    assert _error(_post(server, {"prompt": 1, "bogus": 2}, headers={"Authorization": "Bearer wrong"}), 401)
    for scheme in ("bearer", "BEARER"):
        assert _post(server, NORMAL, headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    for path in ("/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models"):
        assert "API key" in _error(httpx.get(f"{server.url}{path}"), 401)["message"], path
        assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200, path
    assert httpx.get(f"{server.url}/health").status_code == 200


def _wait_idle(server, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.metric("num_requests_running") == 0 and server.metric("num_requests_waiting") == 0:
            return
        time.sleep(0.1)
    pytest.fail("the server did not become idle")


def test_non_streaming_disconnect_aborts(server):
    _wait_idle(server)
    finished, before = server.metric("request_success_total"), server.metric("generation_tokens_total")
    body = NORMAL | {"max_tokens": MAX_SEQ_LEN - 10, "n": MAX_WAITING}  # 4 x 502 tokens, one at a time
    with pytest.raises(httpx.ReadTimeout):
        _post(server, body, timeout=0.5)
    _wait_idle(server)
    tokens = server.metric("generation_tokens_total")
    time.sleep(1.0)
    assert server.metric("generation_tokens_total") == tokens  # nothing runs any more
    # aborted, not run to the end (the first choice may finish before the next disconnect check)
    assert tokens - before < MAX_WAITING * body["max_tokens"]
    assert server.metric("request_success_total") - finished < MAX_WAITING
    assert server.metric("kv_cache_free_blocks") == server.metric("kv_cache_total_blocks")


def test_a_failing_step_fails_only_its_requests(server, fault_file):
    _wait_idle(server)
    queued = [NORMAL | {"prompt": [9 + i, 10, 11]} for i in range(3)]
    expected = [_text(_post(server, b)) for b in queued]  # their answers on a healthy server
    answers = [None] * len(queued)

    def send(i):
        answers[i] = _post(server, queued[i])

    long = NORMAL | {"max_tokens": MAX_SEQ_LEN - 10, "stream": True}
    with httpx.Client(timeout=60, headers=AUTH) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json=long) as running:
            lines = (line for line in running.iter_lines() if line)
            next(lines)  # running: the next requests queue behind it (--max-num-seqs 1)
            threads = [threading.Thread(target=send, args=(i,)) for i in range(len(queued))]
            threads[0].start()
            threads[1].start()
            time.sleep(0.3)
            _inject(fault_file, "raise")  # the next step sleeps 1 s, then raises
            time.sleep(0.5)
            threads[2].start()               # sent during the failing step
            rest = list(lines)
    for t in threads:
        t.join(60)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert "injected fault" in error["message"] and error["code"] == 500, error
    assert [_text(a) for a in answers] == expected
    assert httpx.get(f"{server.url}/health").status_code == 200
    _wait_idle(server)
    assert server.metric("kv_cache_free_blocks") == server.metric("kv_cache_total_blocks")


def test_json_never_carries_nan():
    from tritonq.serve.protocol import LOGPROB_FLOOR, dumps, finite_logprob
    assert finite_logprob(float("-inf")) == LOGPROB_FLOOR == -9999.0
    assert finite_logprob(float("nan")) == LOGPROB_FLOOR and finite_logprob(-1.5) == -1.5
    with pytest.raises(ValueError):
        dumps({"logprob": float("nan")})


def test_dead_engine_reports_503_and_exits_non_zero(server, fault_file):  # last: it ends the server
    _wait_idle(server)
    long = NORMAL | {"max_tokens": MAX_SEQ_LEN - 10, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long, headers=AUTH, timeout=60) as running:
        lines = (line for line in running.iter_lines() if line)
        next(lines)
        _inject(fault_file, "dead")
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" and "injected device error" in rest[-2], rest[-2:]
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503 and "injected device error" in health.text
    assert _post(server, NORMAL).status_code == 503
    assert server.proc.wait(30) == 1


def test_a_stream_nobody_reads_is_cut_off_at_its_buffer():
    """A client that stops reading: past STREAM_BUFFER_EVENTS unread events its request is aborted
    (an abort command for the engine thread) and the stream ends with an error."""
    import asyncio

    from tritonq.serve.engine_loop import STREAM_BUFFER_EVENTS, EngineLoop, Event, Stream

    async def run():
        loop = EngineLoop(None, metrics=None)
        stream = Stream([[1]], [[None]], asyncio.get_running_loop())
        loop._live.add(stream)
        for _ in range(STREAM_BUFFER_EVENTS + 5):
            loop._deliver(stream, Event(outputs=[]))
        return loop, stream
    loop, stream = asyncio.run(run())
    assert stream.done and stream.queue.qsize() == STREAM_BUFFER_EVENTS + 1
    events = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    assert all(e.error is None for e in events[:-1]) and "did not read" in str(events[-1].error)
    assert loop._commands.get_nowait() == ("abort", stream)


def test_guard_checks_the_key_then_the_body_size():
    """The ASGI guard alone (the server wires it with /health, and /metrics under --open-metrics, open)."""
    import asyncio

    from tritonq.serve.app import _Guard

    async def app(scope, receive, send):  # echoes the body it was replayed
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    guard = _Guard(app, api_key="k", open_paths=("/health", "/metrics"), max_request_bytes=10)

    async def run():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.post("/v1/x", content=b"123"),
                    await client.post("/v1/x", content=b"123", headers={"Authorization": "bEaReR k"}),
                    await client.post("/v1/x", content=b"x" * 11, headers={"Authorization": "Bearer k"}),
                    await client.post("/v1/x", content=b"x" * 11),
                    await client.get("/metrics"), await client.get("/docs")]
    no_key, ok, big, big_no_key, metrics, docs = asyncio.run(run())
    assert no_key.status_code == 401 and ok.status_code == 200 and ok.content == b"123"
    assert big.status_code == 413 and "10 bytes" in big.json()["error"]["message"]
    assert big_no_key.status_code == 401  # the key first: no size hint for strangers
    assert metrics.status_code == 200 and docs.status_code == 401
